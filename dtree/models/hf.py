"""Hugging Face causal LMs through transformers' attention interface.

No model-specific code: every decoder layer of a transformers 5 model calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``.
We register ``"dtree"`` there and switch a model's config to it only while the
runtime runs it, so the same model object still works normally elsewhere. For a
name that transformers has no mask function for, it builds no attention mask at
all, so no O(T^2) mask is ever made. ``q`` and ``k`` arrive already rotated with the
``position_ids`` we pass (tree depths), and ``module.layer_idx`` names the layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..ops.logprobs import OutputHead
from .protocol import AttendFn, ModelSpec

__all__ = ["HFTreeModel", "ATTENTION_NAME"]

ATTENTION_NAME = "dtree"

# transformers' names of the per-layer attention options -> dtree's attend() options
_OPTION_KWARGS = {"softcap": "softcap", "s_aux": "sinks", "sliding_window": "window"}
# keyword arguments that reach the attention function and change nothing it computes
# (model-call flags forwarded to every layer; our own callback)
_HARMLESS_KWARGS = frozenset(
    {
        "dtree_attend",
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
    }
)


def _attention_options(kwargs: dict) -> dict:
    """dtree attend() options from the keyword arguments transformers passes the
    attention function. A non-None argument that is neither an option nor harmless
    could change the attention (a cache, a non-causal flag, a new model feature): it
    is refused by name rather than ignored."""
    options = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        if name in _OPTION_KWARGS:
            options[_OPTION_KWARGS[name]] = value
        elif name == "is_causal":
            if value is not True:
                raise ValueError("dtree trains causal LMs; this attention layer asked for is_causal=False")
        elif name not in _HARMLESS_KWARGS:
            raise ValueError(
                f"the model passed {name!r} to its attention function, which dtree does not implement; "
                "it could change the attention, so dtree refuses rather than ignore it"
            )
    return options


def _dtree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [1, Hq, T, Dk] q, [1, Hkv, T, Dk] k, [1, Hkv, T, Dv] v
    -> ([1, T, Hq, Dv], None). ``softcap``, ``s_aux`` (sinks) and ``sliding_window``
    become the per-layer options of dtree's attention."""
    attend: AttendFn | None = kwargs.get("dtree_attend")
    if attend is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} only runs inside dtree.TreeRuntime; "
            "set the model back to 'sdpa' or 'eager' to use it directly"
        )
    if dropout:
        raise ValueError("attention dropout is not supported by dtree's stack attention; set it to 0 or call model.eval()")
    options = _attention_options(kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"dtree runs one packed row per call, got batch size {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = attend(module.layer_idx, q, k, v, scale, **options)
    return out.unsqueeze(0), None


# torch.compile'd decoder layers break their graph here: the stack attention does host
# work (segment tables) and mutates the KV stack, so it runs eagerly between the
# compiled pre- and post-attention graphs of each layer.
_dtree_attention = torch._dynamo.disable(_dtree_attention)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _dtree_attention)


def _effective_sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if any(t == "sliding_attention" for t in layer_types) else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _is_plain_linear(head: torch.nn.Module) -> bool:
    """True for an ``nn.Linear`` that does exactly ``F.linear(x, weight, bias)`` when
    called: not a subclass (quantized, parametrized, adapter-wrapped), no hooks, no
    patched ``forward``, plain parameters. Anything else goes through the module."""
    from torch.nn.modules import module as nn_module

    global_hooks = any(
        getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")
    )
    return (
        type(head) is torch.nn.Linear
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and not global_hooks
        and "forward" not in vars(head)
        and type(head.weight) is torch.nn.Parameter
        and (head.bias is None or type(head.bias) is torch.nn.Parameter)
    )


class HFTreeModel:
    """Adapter giving a transformers ``*ForCausalLM`` the :class:`TreeModule` methods."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "get_output_embeddings"):
            raise TypeError("HFTreeModel needs a transformers causal LM (a model with .config and an output embedding)")
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError(f"{type(model).__name__} uses final_logit_softcapping, which dtree does not support yet")
        if getattr(config, "logit_scale", None) not in (None, 1, 1.0):
            raise ValueError(f"{type(model).__name__} scales its logits (logit_scale), which dtree does not support yet")
        if model.get_output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no LM head (get_output_embeddings() is None): dtree trains causal LMs; "
                "load the model with AutoModelForCausalLM"
            )
        self.model = model
        self.base = getattr(model, model.base_model_prefix)
        self.config = config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads, v_head_dim = getattr(config, "num_key_value_heads", None) or heads, None
        if getattr(config, "qk_nope_head_dim", None) and getattr(config, "v_head_dim", None):
            # multi-head latent attention (DeepSeek-V2/V3, Kimi): the attention receives K and V
            # expanded from the latent to every query head, keys nope + rope wide, values narrower
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            kv_heads, v_head_dim = heads, config.v_head_dim
        self.spec = ModelSpec(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            intermediate_size=getattr(config, "intermediate_size", 0) or 0,
            max_positions=getattr(config, "max_position_embeddings", None),
            sliding_window=_effective_sliding_window(config),
            name=getattr(config, "model_type", type(model).__name__),
        )
        _register()

    @contextlib.contextmanager
    def _dtree_attention(self) -> Iterator[None]:
        configs = {id(c): c for c in (self.model.config, self.config)}.values()
        saved = [(c, c._attn_implementation) for c in configs]
        try:
            for c, _ in saved:
                c._attn_implementation = ATTENTION_NAME
            yield
        finally:
            for c, old in saved:
                c._attn_implementation = old

    def dtree_scope(self):
        """Context for a whole training step: the model's attention is dtree's while it
        lasts, so layers that HF gradient checkpointing re-runs inside backward (after
        :meth:`dtree_hidden_states` returned) attend through the stack as well."""
        return self._dtree_attention()

    def dtree_spec(self) -> ModelSpec:
        return self.spec

    def dtree_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states."""
        with self._dtree_attention():
            out = self.base(
                input_ids=input_ids.unsqueeze(0),
                position_ids=position_ids.unsqueeze(0),
                use_cache=False,
                dtree_attend=attend,
            )
        return out.last_hidden_state[0]

    def dtree_output_layer(self) -> OutputHead:
        """The LM head as it is now (adapters may have wrapped it since construction):
        the fused path for a plain ``nn.Linear`` (tied or not), else the module path,
        which calls the head itself (PEFT LoRA or ``modules_to_save`` wrappers,
        quantized linears, hooked or patched modules, subclasses)."""
        head = self.model.get_output_embeddings()
        if _is_plain_linear(head):
            return OutputHead(weight=head.weight, bias=head.bias)
        return OutputHead(module=head)

    def dtree_check(self, training: bool) -> None:
        """Raise a ValueError for a model state dtree cannot run, before any compute.
        Runs at every call: these are switched on and off after construction.

        Args:
            training: the call computes gradients (``forward_backward``)."""
        for m in self.model.modules():
            if not m.training:
                continue
            p = getattr(m, "attention_dropout", 0.0)
            if isinstance(p, (int, float)) and p > 0:
                raise ValueError(
                    f"attention dropout ({type(m).__name__}.attention_dropout={p}) is not supported by dtree's stack "
                    "attention: build the model with config.attention_dropout=0 (or set attention_dropout = 0 on every "
                    "attention module), or call model.eval(). Dropout elsewhere (LoRA, residual) is replayed exactly"
                )

    def parameters(self):
        return self.model.parameters()

    def compile_layers(self, **compile_kwargs) -> None:
        """``torch.compile`` every decoder layer, with dynamic shapes (one compiled graph
        serves all layers and all call sizes).

        Eager HF launches ~120 kernels per layer per forward+backward, which costs
        about 40 ms of CPU time per model call on a 28-layer model: calls of a few
        thousand tokens then leave the GPU waiting (benchmarks/PERF_NOTES.md). The
        compiled layers fuse the norms, rotary, activation and residual ops. The
        layers are compiled in place, so the model runs compiled everywhere; compiling
        twice is a no-op.
        """
        layers = getattr(self.base, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(f"{type(self.model).__name__} has no decoder layer list at .{self.model.base_model_prefix}.layers")
        for layer in layers:
            if not getattr(layer, "_dtree_compiled", False):
                layer.compile(**{"dynamic": True, **compile_kwargs})
                layer._dtree_compiled = True
