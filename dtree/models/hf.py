"""Hugging Face causal LMs through transformers' attention interface.

No model-specific code for most models: every decoder layer of a transformers 5 model
calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``.
We register ``"dtree"`` there (:mod:`dtree.models.attention_function`) and switch a
model's config to it only while the runtime runs it, so the same model object still
works normally elsewhere. For a name that transformers has no mask function for, it
builds no attention mask at all, so no O(T^2) mask is ever made. ``q`` and ``k`` arrive already rotated with the
``position_ids`` we pass (tree depths), and ``module.layer_idx`` names the layer.

The few families whose attention bypasses the interface (Bloom, Falcon, GPT-J, ...)
get a minimal adapter from :mod:`dtree.models.families`. Nothing is silently wrong:
every model call checks that each decoder layer's attention went through dtree once,
with the K/V shapes of the stack (:mod:`dtree.models.guard`), and a one-time probe
checks the LM head's logit transform and the decoder against the model's own forward
(:mod:`dtree.models.probe`). Otherwise a ``ValueError`` names the model and the reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import traceback
from typing import Callable, Iterator

import torch

from ..ops.logprobs import OutputHead
from . import families, mixers
from .attention_function import ATTENTION_NAME, register_attention_function
from .guard import AttentionCalls, activate
from .instance_attrs import module_attr
from .layer_kinds import layer_fields, state_grads
from .layer_list import find_decoder_layers
from .protocol import AttendFn, ModelSpec
from .plain_linear import is_plain_linear

__all__ = ["HFTreeModel", "ATTENTION_NAME"]

# class-name fragments of token mixers other than attention, for error hints
_MIXER_NAMES = ("mamba", "mixer", "conv", "recurrent", "rwkv", "lstm", "ssm", "deltanet", "lightning", "rglru", "linearattention")


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


# model_type -> ModelSpec fields for families whose attention function receives other K/V
# shapes than their config's standard names say
_RECEIVED_KV = {
    "jetmoe": lambda c: {"num_kv_heads": c.num_attention_heads},  # K/V tiled to every query head (top-k experts)
}


def _raise_for_model_crash(error: Exception, name: str) -> None:
    """Turn a TypeError/AttributeError/IndexError raised in a transformers model's own
    code while dtree ran it into a ValueError that says so (typically the model reads
    the attention mask that transformers builds for its own implementations and builds
    none for dtree's). Errors from anywhere else propagate unchanged."""
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1] if frames else None
    if where is None or "/transformers/models/" not in where.filename.replace("\\", "/"):
        return
    raise ValueError(
        f"{name} failed in its own code while dtree ran it ({where.filename.rsplit('/', 1)[-1]}:{where.lineno}: "
        f"{type(error).__name__}: {error}): it likely reads the attention mask that transformers builds for its own "
        "attention implementations (dtree's attention takes none), e.g. a sparse-attention indexer; dtree cannot run it"
    ) from error


def _largest(size) -> int:
    """A config size that may be per layer (a list, Gemma 3n) as one int (the largest)."""
    return int(max(size)) if isinstance(size, (list, tuple)) else int(size or 0)


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (what returns the final hidden states):
    ``model.<base_model_prefix>``, else ``model.model`` or ``model.transformer``
    (Llama4ForCausalLM names a prefix it does not use)."""
    for name in (getattr(model, "base_model_prefix", ""), "model", "transformer"):
        base = getattr(model, name, None) if name else None
        if isinstance(base, torch.nn.Module) and base is not model:
            return base
    raise TypeError(f"{type(model).__name__}: cannot find its base model (the decoder stack under the LM head)")


def _logit_transform(config) -> tuple[float, float | None]:
    """(logit_scale, final_softcap) of the model's logits, from the config names the
    families use: Granite divides by ``logits_scaling``, Cohere multiplies by
    ``logit_scale``, Gemma 2/3 soft-cap with ``final_logit_softcapping``. The probe
    (:mod:`dtree.models.probe`) verifies the result against the model's forward."""
    scale = 1.0
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


def _in_call_context(checkpoint_func: Callable) -> Callable:
    """HF's ``_gradient_checkpointing_func(function, *args)``, with ``function`` run in a
    copy of the current ``contextvars`` context, in forward and in its re-run."""

    @functools.wraps(checkpoint_func)
    def run(function, *args, **kwargs):
        return checkpoint_func(functools.partial(contextvars.copy_context().run, function), *args, **kwargs)

    return run


@contextlib.contextmanager
def _hf_checkpointing_in_call_context(model: torch.nn.Module) -> Iterator[None]:
    """While one dtree model call runs, HF gradient checkpointing runs each layer in a
    copy of the call's context. HF re-runs a checkpointed layer inside backward, after
    :meth:`HFTreeModel.dtree_hidden_states` returned and reset the active call
    (:func:`dtree.models.guard.activate`); the copy keeps it for the re-run, so the
    re-run attends through the same group's ``attend`` (as the forward did) and family
    adapters still dispatch. The re-run's attention calls come after the call's
    per-layer check, so they are not counted against it."""
    wrapped = []
    for m in model.modules():
        func = m.__dict__.get("_gradient_checkpointing_func")
        if func is not None and getattr(m, "gradient_checkpointing", False) is True and m.training:
            m._gradient_checkpointing_func = _in_call_context(func)
            wrapped.append((m, func))
    try:
        yield
    finally:
        for m, func in wrapped:
            m._gradient_checkpointing_func = func


class HFTreeModel:
    """Adapter giving a transformers ``*ForCausalLM`` the :class:`TreeModule` methods."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "get_output_embeddings"):
            raise TypeError("HFTreeModel needs a transformers causal LM (a model with .config and an output embedding)")
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if model.get_output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no LM head (get_output_embeddings() is None): dtree trains causal LMs; "
                "load the model with AutoModelForCausalLM"
            )
        self.model = model
        self.name = type(model).__name__
        self.base = _base_model(model)
        self.config = config
        self.logit_scale, self.final_softcap = _logit_transform(config)
        try:
            heads = getattr(config, "num_attention_heads", None)
            if not heads:
                raise ValueError(
                    f"{self.name} has no attention (its config has no num_attention_heads): a recurrent or state-space "
                    "model carries state along the sequence instead of a KV cache, which dtree cannot split at tree "
                    "branches"
                )
            self.spec = self._spec(model, config, self.base)
        except Exception as error:  # heterogeneous configs refuse global reads of per-layer sizes
            if type(error).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            raise ValueError(
                f"{self.name}: its layers have different attention shapes and the config refuses a global read the "
                f"spec needs ({error}); dtree cannot size its stacks"
            ) from error
        self.adapted = families.install(model) + mixers.install(model)
        self._layer_of_module: dict[int, int] | None = None
        self._probed: set = set()
        self._own_attention: dict[int, str] = {}  # config id -> the model's attention implementation
        register_attention_function()

    @staticmethod
    def _config_kv(config, heads: int) -> tuple[int, int, int | None] | None:
        """(kv_heads, head_dim, v_head_dim or None) from the config's standard names; None
        when the config keeps them per layer and refuses a global read (Gemma 4)."""
        try:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            kv_heads, v_head_dim = getattr(config, "num_key_value_heads", None) or heads, None
        except Exception as error:
            if type(error).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            return None
        if getattr(config, "v_head_dim", None) and config.v_head_dim != head_dim:  # values narrower (MiMo)
            v_head_dim = config.v_head_dim
        if getattr(config, "qk_nope_head_dim", None) and getattr(config, "v_head_dim", None):
            # multi-head latent attention (DeepSeek-V2/V3, Kimi): the attention receives K and V
            # expanded from the latent to every query head, keys nope + rope wide, values narrower
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
            kv_heads, v_head_dim = heads, config.v_head_dim
        return kv_heads, head_dim, v_head_dim

    @staticmethod
    def _spec(model: torch.nn.Module, config, base: torch.nn.Module) -> ModelSpec:
        """Shapes from the config's standard names (with the corrections of
        :data:`_RECEIVED_KV` and :func:`families.spec_overrides`), and per layer which
        attend with which K/V shape and which carry recurrent states
        (:func:`dtree.models.layer_kinds.layer_fields`); the K/V shapes are checked
        against what each layer's attention receives at every call."""
        heads = config.num_attention_heads
        kv_heads, head_dim, v_head_dim = HFTreeModel._config_kv(config, heads) or (None, None, None)
        fields = dict(
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            intermediate_size=_largest(getattr(config, "intermediate_size", 0)),
            max_positions=getattr(config, "max_position_embeddings", None),
            sliding_window=_effective_sliding_window(config),
            name=getattr(config, "model_type", type(model).__name__),
        )
        fields.update(_RECEIVED_KV.get(fields["name"], lambda c: {})(config))
        fields.update(families.spec_overrides(model, config))
        known = fields["head_dim"] is not None
        kv = (fields["num_kv_heads"], fields["head_dim"], fields["v_head_dim"] or fields["head_dim"]) if known else None
        layers = list(find_decoder_layers(base, config.num_hidden_layers) or [])
        fields.update(layer_fields(layers, config, heads, kv, type(model).__name__))
        if not known:  # the first attending layer's shape stands for the model in global reads
            fields["num_kv_heads"], fields["head_dim"], v_dim = next(s for s in fields["layer_kv"] if s is not None)
            fields["v_head_dim"] = v_dim if v_dim != fields["head_dim"] else None
        return ModelSpec(**fields)

    def _configs(self) -> list:
        return list({id(c): c for c in (self.model.config, self.config)}.values())

    @contextlib.contextmanager
    def _routed_through_dtree(self) -> Iterator[None]:
        """The model's configs' ``_attn_implementation`` is :data:`ATTENTION_NAME` while
        the block runs (restored after), so its layers call dtree's attention function."""
        saved = [(c, c._attn_implementation) for c in self._configs()]
        for c, old in saved:
            if old != ATTENTION_NAME:  # the outermost switch knows the model's own implementation
                self._own_attention[id(c)] = old
        try:
            for c, _ in saved:
                c._attn_implementation = ATTENTION_NAME
            yield
        finally:
            for c, old in saved:
                c._attn_implementation = old

    @contextlib.contextmanager
    def own_attention(self) -> Iterator[None]:
        """The model's own attention implementation while the block runs, also inside
        :meth:`dtree_scope` (the probe runs the model's own forward)."""
        saved = [(c, c._attn_implementation) for c in self._configs()]
        try:
            for c, impl in saved:
                if impl == ATTENTION_NAME:
                    c._attn_implementation = self._own_attention.get(id(c), "sdpa")
            yield
        finally:
            for c, impl in saved:
                c._attn_implementation = impl

    def dtree_scope(self):
        """Context for a whole training step: the model's attention is dtree's while it
        lasts, so layers that HF gradient checkpointing re-runs inside backward (after
        :meth:`dtree_hidden_states` returned) attend through the stack as well."""
        return self._routed_through_dtree()

    def dtree_spec(self) -> ModelSpec:
        return self.spec

    def decoder_layers(self) -> list[torch.nn.Module]:
        """The model's decoder layers (read at every call: adapters may wrap them)."""
        return list(find_decoder_layers(self.base, self.spec.num_layers) or [])

    def _layer_of(self, module: torch.nn.Module) -> int | None:
        """Decoder layer index of an attention module without an integer ``layer_idx``."""
        if self._layer_of_module is None or id(module) not in self._layer_of_module:
            self._layer_of_module = {
                id(m): i for i, layer in enumerate(self.decoder_layers()) for m in layer.modules()
            }
        return self._layer_of_module.get(id(module))

    def dtree_hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states. Raises a ValueError
        (after the call) unless every decoder layer's attention went through ``attend``
        exactly once."""
        calls = AttentionCalls(attend, self.spec, self.name, self._layer_of)
        extra = families.call_kwargs(self.adapted, input_ids.device)
        try:
            with self._routed_through_dtree(), activate(calls), _hf_checkpointing_in_call_context(self.model):
                out = self.base(
                    input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), use_cache=False, **extra
                )
        except (TypeError, AttributeError, IndexError) as error:
            _raise_for_model_crash(error, self.name)
            raise
        calls.check_every_layer(self.decoder_layers())
        hidden = getattr(out, "last_hidden_state", None)
        return (hidden if hidden is not None else out[0]).squeeze(0)  # [T, H]: a view back, not a select's copy

    def head_transform(self) -> str:
        """What dtree applies to the head's logits, for messages."""
        parts = [f"logit_scale={self.logit_scale:g}"]
        if self.final_softcap is not None:
            parts.append(f"final_softcap={self.final_softcap:g}")
        return ", ".join(parts)

    def mixer_hint(self) -> str:
        """' (suspects: ...)' naming modules that look like token mixers other than attention."""
        names = sorted(
            {type(m).__name__ for m in self.model.modules() if any(k in type(m).__name__.lower() for k in _MIXER_NAMES)}
        )
        return f" (suspects: {', '.join(names[:4])})" if names else ""

    def dtree_output_layer(self) -> OutputHead:
        """The LM head as it is now (adapters may have wrapped it since construction):
        the fused path for a plain ``nn.Linear`` (tied or not), else the module path,
        which calls the head itself (PEFT LoRA or ``modules_to_save`` wrappers,
        quantized linears, hooked or patched modules, subclasses). With the config's
        logit transform (:func:`_logit_transform`). The first time for a head,
        device and dtype, the model is probed (:func:`dtree.models.probe.check_model`)."""
        module = self.model.get_output_embeddings()
        transform = dict(logit_scale=self.logit_scale, final_softcap=self.final_softcap)
        if is_plain_linear(module):
            head = OutputHead(weight=module.weight, bias=module.bias, **transform)
        else:
            head = OutputHead(module=module, **transform)
        families.check(self.model, self.name)
        param = module.weight if isinstance(getattr(module, "weight", None), torch.Tensor) else None
        param = param if param is not None else next(self.model.parameters())
        key = (id(module), id(param), param.device, param.dtype)
        if key not in self._probed:
            from .probe import check_model

            check_model(self, head)
            self._probed.add(key)
        return head

    def dtree_state_grads(self) -> tuple[bool, ...]:
        """Per decoder layer, whether its recurrent states can need a gradient now (read at
        every step: parameters are frozen and unfrozen; :func:`layer_kinds.state_grads`)."""
        return state_grads(self.model.get_input_embeddings(), self.decoder_layers())

    def dtree_check(self, training: bool) -> None:
        """Raise a ValueError for a model state dtree cannot run, before any compute.
        Runs at every call: these are switched on and off after construction.

        Args:
            training: the call computes gradients (``forward_backward``)."""
        for m in self.model.modules():
            if not m.training:
                continue
            p, where = module_attr(m, "attention_dropout", 0.0), f"{type(m).__name__}.attention_dropout"
            adapted = families.attention_dropout(m)  # the probability dropout of an adapted family's attention
            if adapted is not None:
                p, where = adapted, f"{type(m).__name__}'s attention dropout p"
            if isinstance(p, (int, float)) and p > 0:
                raise ValueError(
                    f"attention dropout ({where}={p}) is not supported by dtree's stack attention: build the model "
                    "with config.attention_dropout=0 (or set attention_dropout = 0 on every attention module), or call "
                    "model.eval(). Dropout elsewhere (LoRA, residual) is replayed exactly"
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
        layers = self.decoder_layers()
        if not layers:
            raise ValueError(
                f"{self.name} has no list of {self.spec.num_layers} decoder layers under .{self.model.base_model_prefix}"
            )
        for layer in layers:
            if not getattr(layer, "_dtree_compiled", False):
                layer.compile(**{"dynamic": True, **compile_kwargs})
                layer._dtree_compiled = True
