"""dtree's entry point in transformers' attention interface.

Every decoder layer of a transformers 5 model calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, ...)``.
:func:`register_attention_function` registers :func:`dtree_attention_function` there
under :data:`ATTENTION_NAME`; :class:`dtree.models.hf.HFTreeModel` switches a model's
config to that name only while dtree runs it. The function hands each layer's q/k/v
to the :class:`~dtree.models.guard.AttentionCalls` of the running model call (which
attends through the KV stack and counts the layer).

It refuses, with a ``ValueError``, whatever it cannot compute exactly rather than
ignore it: attention dropout (the stack attention has none), an attention mask or
score bias that the model made itself (transformers builds no mask for dtree's name;
dtree masks the tree itself), ``is_causal=False``, a batch of more than one row, and
any keyword argument it does not know (a cache, a new model feature), by name. Outside
a dtree model call it raises a ``RuntimeError``.
"""

from __future__ import annotations

import torch

from .guard import active_call

__all__ = ["ATTENTION_NAME", "attention_options", "dtree_attention_function", "register_attention_function"]

ATTENTION_NAME = "dtree"

# transformers' names of the per-layer attention options -> dtree's attend() options
_OPTION_KWARGS = {"softcap": "softcap", "s_aux": "sinks", "sliding_window": "window"}
# keyword arguments that reach the attention function and change nothing it computes
# (model-call flags forwarded to every layer)
_HARMLESS_KWARGS = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
    }
)


def attention_options(kwargs: dict, model_name: str = "the model") -> dict:
    """dtree attend() options (``softcap``, ``sinks``, ``window``) from the keyword
    arguments transformers passes the attention function. A non-None argument that is
    neither an option nor harmless could change the attention (a cache, a non-causal
    flag, a new model feature): it is refused by name rather than ignored."""
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
                f"{model_name} passed {name!r} to its attention function, which dtree does not implement; "
                "it could change the attention, so dtree refuses rather than ignore it"
            )
    return options


# torch.compile'd decoder layers break their graph here: the stack attention does host
# work (segment tables) and mutates the KV stack, so it runs eagerly between the
# compiled pre- and post-attention graphs of each layer.
@torch._dynamo.disable
def dtree_attention_function(
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
    become the per-layer options of dtree's attention (:func:`attention_options`)."""
    calls = active_call()
    if calls is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} only runs inside a dtree model call (TreeRuntime or a "
            "baseline); set the model back to 'sdpa' or 'eager' to use it directly"
        )
    if dropout:
        raise ValueError("attention dropout is not supported by dtree's stack attention; set it to 0 or call model.eval()")
    if attention_mask is not None:
        # transformers builds no mask for dtree's implementation: this one is the model's own
        # (a learned or input-dependent score bias, e.g. Doge's dynamic mask)
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"{calls.model_name}: {type(module).__name__} passes its own attention mask or score bias ({shape}) to the "
            "attention function; dtree's attention masks the tree itself and cannot apply a model-made mask"
        )
    options = attention_options(kwargs, calls.model_name)
    if query.shape[0] != 1:
        raise ValueError(f"dtree runs one packed row per call, got batch size {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # squeeze, not [0]: a select's backward zero-fills the whole input and copies the gradient in (two
    # launches per tensor, and the q/k projections' view backward then copies again); a squeeze's is a view
    q = query.squeeze(0).transpose(0, 1)  # [T, Hq, D]
    k = key.squeeze(0).transpose(0, 1)
    v = value.squeeze(0).transpose(0, 1)
    out = calls(module, q, k, v, scale, **options)
    return out.unsqueeze(0), None


def register_attention_function() -> None:
    """Register :func:`dtree_attention_function` in transformers' ``AttentionInterface``
    as :data:`ATTENTION_NAME` (idempotent: registering again replaces the same entry)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, dtree_attention_function)
