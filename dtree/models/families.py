"""Adapters for transformers attention classes that bypass the attention interface.

Most transformers 5 models call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
in every attention layer, which is where dtree's attention plugs in
(:mod:`dtree.models.hf`). A few older families compute attention inline, with their
own masks and ALiBi, so dtree's function is never called and their attention would
run unmasked over the packed row. For each such class this module holds one minimal
adapter: it computes q, k, v exactly as the original (same projections, splits,
rotary, clipping), calls dtree's attention with the family's scale and options, and
applies the output projection as the original does.

    Bloom     BloomAttention.forward            ALiBi (slopes read off build_alibi_tensor)
    Falcon    FalconAttention.forward           rotary, or ALiBi added before the 1/sqrt(d) scale;
              FalconFlashAttention2.forward     new architecture (grouped K/V), multi-query, classic
    GPT-J     GPTJAttention._attn               the attention core (q, k, v come rotated);
              GPTJFlashAttention2.forward       runs the eager forward above (both through 5.23:
                                                from 5.24 GPT-J uses the attention interface)
    CodeGen   CodeGenAttention._attn            the attention core (through 5.23, as GPT-J)
    GPT-Neo   GPTNeoSelfAttention._attn         unscaled scores; "local" layers: window_size
              GPTNeoFlashAttention2.forward     runs the eager forward above
    MPT       MptAttention.forward              ALiBi (build_mpt_alibi_tensor), clip_qkv
    GPT-NeoX-Japanese  GPTNeoXJapaneseAttention._attn  the attention core
    GPT-1     Attention._attn (openai)          the core; k arrives transposed, scale only if built with it
    XGLM      XGLMAttention.forward             self-attention, q scaled in the projection step

How an adapter is installed: :func:`install` (called when dtree wraps a model) replaces
the method on the class once, with a dispatcher that runs the original method unless
a dtree model call is active in the current context (:func:`dtree.models.guard.active_call`).
So the model runs as before everywhere else, including in other threads, and a
checkpointed layer recomputed in backward under the captured context runs the adapter
again. Each adapter is tested exact against HF run per path (tests/test_families.py).

Versions: each adapter names the leading parameters of the method it replaces and the
last transformers release it was tested with. A release where that method is gone and
the class calls transformers' attention interface instead needs no adapter (the family
then runs like any other); one where the method was renamed, reordered or removed
otherwise is refused with a ``ValueError`` naming the family and both versions.

ALiBi conventions (see :mod:`dtree.ops.stack_attention.reference`): Bloom and MPT add
``slope * pos_k`` after scaling, which differs from dtree's ``-slope * (pos_q - pos_k)``
by a per-row constant that softmax ignores; Falcon adds it before scaling, so its
slopes are multiplied by the scale. Falcon rounds ``slope * position`` to bfloat16;
with a power-of-two number of heads its slopes are powers of two and that product is
exact below position 256, where dtree matches it exactly; beyond that dtree's linear
bias is the unrounded one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .guard import AttentionCalls, active_call

__all__ = ["install", "check", "attention_dropout", "spec_overrides", "call_kwargs", "adapted_classes", "ADAPTED_CLASSES"]


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, D] -> [T, heads, D] (dtree runs one packed row per call)."""
    if x.shape[0] != 1:
        raise ValueError(f"dtree runs one packed row per model call, got batch size {x.shape[0]}")
    return x.squeeze(0).transpose(0, 1)  # a view's backward: no zero-filled copy as a select's


def _heads_first(out: torch.Tensor) -> torch.Tensor:
    """[T, heads, D] -> [1, heads, T, D]."""
    return out.transpose(0, 1).unsqueeze(0)


def _refuse_attention_dropout(module: torch.nn.Module, p: float) -> None:
    # dtree_check refuses this before any compute; kept here for direct use of a model
    if module.training and p > 0:
        raise ValueError(
            f"attention dropout ({type(module).__name__}, p={p}) is not supported by dtree's stack attention: "
            "build the model with attention dropout 0, or call model.eval()"
        )


# ---------------------------------------------------------------------------- Bloom
def _bloom_slopes(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """[heads] float32: Bloom's ALiBi slopes, as its own ``build_alibi_tensor`` makes
    them (its bias at position 1 of an unpadded row is the slope)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, device=device), module.num_heads, torch.float32)
    return alibi[:, 0, 1]


def _bloom_forward(self, calls: AttentionCalls, hidden_states, residual, alibi, attention_mask, *args, **kwargs):
    """``BloomAttention.forward``: scores = q.k / sqrt(d) + slope * pos_k (beta = 1)."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    _refuse_attention_dropout(self, self.attention_dropout.p)
    batch, length, _ = hidden_states.shape
    q, k, v = self._reshape(self.query_key_value(hidden_states))  # 3 x [B, H, T, D]
    if self.beta != 1.0:
        raise ValueError(f"BloomAttention with beta={self.beta}: dtree's ALiBi adapter assumes Bloom's beta = 1")
    out = calls(
        self, _tokens(q), _tokens(k), _tokens(v), self.inv_norm_factor,
        alibi_slopes=_bloom_slopes(self, hidden_states.device),
    )
    context = out.reshape(batch, length, self.num_heads * self.head_dim)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            a, b = int(i * slices), int((i + 1) * slices)
            output = output + F.linear(context[:, :, a:b], self.dense.weight[:, a:b])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


# ---------------------------------------------------------------------------- Falcon
def _falcon_kv_heads(config) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def _falcon_slopes(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """[heads] float32: Falcon's ALiBi slopes (its ``build_alibi_tensor``, bf16-rounded
    as there), times the 1/sqrt(d) scale Falcon applies after adding the bias."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long, device=device), module.num_heads, torch.float32)
    return alibi[:, 0, 1] * module.inv_norm_factor


def _falcon_forward(
    self, calls: AttentionCalls, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
    use_cache=False, output_attentions=False, position_embeddings=None, **kwargs,
):
    """``FalconAttention.forward`` (and the flash subclass): K/V stay grouped (the
    original broadcasts them to every query head), rotary when there is no ALiBi."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    fused = self.query_key_value(hidden_states)
    batch, length, _ = fused.shape
    d = self.head_dim
    if self.new_decoder_architecture:
        qkv = fused.view(batch, length, -1, self.num_heads // self.num_kv_heads + 2, d)
        q = qkv[:, :, :, :-2].flatten(2, 3)  # query head h reads kv group h // (heads / kv_heads)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    else:
        q, k, v = self._split_heads(fused)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, heads, T, D]
    options = {}
    if alibi is None:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    else:
        _refuse_attention_dropout(self, self.attention_dropout.p)
        options["alibi_slopes"] = _falcon_slopes(self, hidden_states.device)
    out = calls(self, _tokens(q), _tokens(k), _tokens(v), self.inv_norm_factor, **options)
    return self.dense(out.reshape(batch, length, self.num_heads * d)), None


# ---------------------------------------------------------------------------- GPT-J, CodeGen, GPT-Neo
def _attn_core(
    scale: Callable[[torch.nn.Module], float],
    window: Callable[[torch.nn.Module], int | None] = lambda m: None,
    dropout: str = "attn_dropout",
):
    """An ``_attn(query, key, value, attention_mask)`` method ([B, H, T, D] each, q and
    k rotated) -> ([B, H, T, D], None) through dtree."""

    def core(self, calls: AttentionCalls, query, key, value, attention_mask=None, *args, **kwargs):
        _refuse_attention_dropout(self, getattr(self, dropout).p)
        w = window(self)
        options = {"window": w} if w is not None else {}
        out = calls(self, _tokens(query), _tokens(key), _tokens(value), scale(self), **options)
        return _heads_first(out).to(value.dtype), None

    return core


def _eager_forward(module_name: str, eager_class: str):
    """For a flash-attention subclass: run the eager parent's forward, whose ``_attn``
    is the adapted core."""

    def forward(self, calls: AttentionCalls, *args, **kwargs):
        parent = getattr(importlib.import_module(module_name), eager_class)
        return parent.forward(self, *args, **kwargs)

    return forward


def _gpt_neo_window(module: torch.nn.Module) -> int | None:
    return module.config.window_size if module.attention_type == "local" else None


def _openai_gpt_attn(self, calls: AttentionCalls, q, k, v, attention_mask=None, output_attentions=False):
    """GPT-1's ``Attention._attn``: k arrives transposed ([B, H, D, T]); scores are
    divided by sqrt(d) only when the block was built with ``scale=True``."""
    _refuse_attention_dropout(self, self.attn_dropout.p)
    scale = v.size(-1) ** -0.5 if self.scale else 1.0
    out = calls(self, _tokens(q), _tokens(k.transpose(-1, -2)), _tokens(v), scale)
    return [_heads_first(out)]


def _xglm_forward(self, calls: AttentionCalls, hidden_states, key_value_states=None, *args, **kwargs):
    """``XGLMAttention.forward`` (self-attention; q is scaled by its projection step)."""
    if key_value_states is not None:
        raise ValueError("XGLMAttention as cross-attention (add_cross_attention) is not a causal LM layer dtree can run")
    _refuse_attention_dropout(self, self.dropout)
    batch, length, _ = hidden_states.shape
    q, k, v = (
        x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        for x in (self.q_proj(hidden_states) * self.scaling, self.k_proj(hidden_states), self.v_proj(hidden_states))
    )
    out = calls(self, _tokens(q), _tokens(k), _tokens(v), 1.0)
    return self.out_proj(out.reshape(batch, length, self.embed_dim)), None


# ---------------------------------------------------------------------------- MPT
def _mpt_slopes(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """[heads] float32: MPT's slopes from its ``build_mpt_alibi_tensor`` (as MptModel
    calls it, default ``alibi_bias_max``): the bias of key 0 for query 1 is -slope."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    return -build_mpt_alibi_tensor(module.n_heads, 2, device=device)[:, 0, 0].float()


def _mpt_forward(self, calls: AttentionCalls, hidden_states, position_bias, *args, **kwargs):
    """``MptAttention.forward``: clip_qkv, scores * softmax_scale + ALiBi."""
    _refuse_attention_dropout(self, self.attn_dropout_p)
    batch, length = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    q, k, v = (x.reshape(batch, length, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, dim=2))
    options = {"alibi_slopes": _mpt_slopes(self, hidden_states.device)} if position_bias is not None else {}
    out = calls(self, _tokens(q), _tokens(k), _tokens(v), self.softmax_scale, **options)
    return self.out_proj(out.reshape(batch, length, -1)), None


# ---------------------------------------------------------------------------- registry
#: The transformers releases the adapters were last tested against (tests/test_families.py
#: in CI); a family whose adapted method changed after it is refused by name, never guessed.
LAST_TESTED_TRANSFORMERS = "5.24.0"


@dataclass(frozen=True)
class _Adapter:
    """The replacement of ``cls.method`` while dtree runs the model: called as
    ``replacement(self, calls, *args, **kwargs)`` with the active :class:`AttentionCalls`.

    ``params``: the leading parameter names (after ``self``) of the original method that
    the replacement reads positionally; a release that renames or reorders them is
    refused. ``tested_through``: the last transformers release in which this method
    existed and was tested (a family that later moved its attention onto transformers'
    attention interface needs no adapter there: GPT-J and CodeGen in 5.24)."""

    module: str
    cls: str
    method: str
    replacement: Callable
    dropout: Callable[[torch.nn.Module], float]
    params: tuple[str, ...]
    tested_through: str = LAST_TESTED_TRANSFORMERS


_BLOOM, _FALCON = "transformers.models.bloom.modeling_bloom", "transformers.models.falcon.modeling_falcon"
_GPTJ, _CODEGEN = "transformers.models.gptj.modeling_gptj", "transformers.models.codegen.modeling_codegen"
_GPT_NEO, _MPT = "transformers.models.gpt_neo.modeling_gpt_neo", "transformers.models.mpt.modeling_mpt"


def _p(name: str) -> Callable[[torch.nn.Module], float]:
    return lambda m: getattr(m, name).p


_GPTJ_CORE = _attn_core(lambda m: 1.0 / m.scale_attn)
_GPT_NEO_CORE = _attn_core(lambda m: 1.0, _gpt_neo_window)
_NEOX_JA_CORE = _attn_core(lambda m: 1.0 / m.norm_factor, dropout="attention_dropout")
_NEOX_JA = "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese"
_OPENAI, _XGLM = "transformers.models.openai.modeling_openai", "transformers.models.xglm.modeling_xglm"
_QKV_MASK = ("query", "key", "value", "attention_mask")

_ADAPTERS = (
    _Adapter(
        _BLOOM, "BloomAttention", "forward", _bloom_forward, _p("attention_dropout"),
        ("hidden_states", "residual", "alibi", "attention_mask"),
    ),
    _Adapter(
        _FALCON, "FalconAttention", "forward", _falcon_forward, _p("attention_dropout"),
        ("hidden_states", "alibi", "attention_mask"),
    ),
    _Adapter(
        _FALCON, "FalconFlashAttention2", "forward", _falcon_forward, _p("attention_dropout"),
        ("hidden_states", "alibi", "attention_mask"),
    ),
    _Adapter(_GPTJ, "GPTJAttention", "_attn", _GPTJ_CORE, _p("attn_dropout"), _QKV_MASK, "5.23.0"),
    _Adapter(
        _GPTJ, "GPTJFlashAttention2", "forward", _eager_forward(_GPTJ, "GPTJAttention"), _p("attn_dropout"), (),
        "5.23.0",
    ),
    _Adapter(_CODEGEN, "CodeGenAttention", "_attn", _GPTJ_CORE, _p("attn_dropout"), _QKV_MASK, "5.23.0"),
    _Adapter(_GPT_NEO, "GPTNeoSelfAttention", "_attn", _GPT_NEO_CORE, _p("attn_dropout"), _QKV_MASK),
    _Adapter(
        _GPT_NEO, "GPTNeoFlashAttention2", "forward", _eager_forward(_GPT_NEO, "GPTNeoSelfAttention"),
        _p("attn_dropout"), (),
    ),
    _Adapter(_MPT, "MptAttention", "forward", _mpt_forward, lambda m: m.attn_dropout_p, ("hidden_states", "position_bias")),
    _Adapter(_NEOX_JA, "GPTNeoXJapaneseAttention", "_attn", _NEOX_JA_CORE, _p("attention_dropout"), _QKV_MASK),
    _Adapter(_OPENAI, "Attention", "_attn", _openai_gpt_attn, _p("attn_dropout"), ("q", "k", "v", "attention_mask")),
    _Adapter(_XGLM, "XGLMAttention", "forward", _xglm_forward, lambda m: m.dropout, ("hidden_states", "key_value_states")),
)
_BY_CLASS = {(a.module, a.cls): a for a in _ADAPTERS}
ADAPTED_CLASSES = tuple(a.cls for a in _ADAPTERS)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _uses_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention interface
    (then dtree's attention function receives its q, k, v, as for any other family)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _target_state(cls: type, adapter: _Adapter) -> str:
    """``"adapt"``: the method the adapter replaces is there, as tested; ``"interface"``:
    it is gone and the class now goes through the attention interface (no adapter);
    ``"changed"``: anything else (gone, or its parameters renamed or reordered)."""
    original = getattr(cls, adapter.method, None)  # inspect.signature sees through an installed dispatcher
    if original is None:
        return "interface" if _uses_attention_interface(cls) else "changed"
    names = [p for p in inspect.signature(original).parameters][1:]
    return "adapt" if tuple(names[: len(adapter.params)]) == adapter.params else "changed"


@functools.lru_cache(maxsize=None)
def _active_adapter(cls: type) -> _Adapter | None:
    """The adapter to install on ``cls`` under the installed transformers (None: not an
    adapted class, or one that now uses the attention interface); raises for a class
    whose adapted method changed since the adapter was tested."""
    adapter = _BY_CLASS.get((cls.__module__, cls.__name__))
    if adapter is None:
        return None
    state = _target_state(cls, adapter)
    if state == "changed":
        family = adapter.module.rsplit(".", 1)[-1].removeprefix("modeling_")
        raise ValueError(
            f"{family}: transformers {_transformers_version()} changed {adapter.cls}.{adapter.method}, which dtree's "
            f"adapter for this family replaces (last tested with transformers {adapter.tested_through}); dtree cannot "
            "run it exactly: install a transformers release dtree supports (see pyproject.toml) or report it"
        )
    return adapter if state == "adapt" else None


def _adapter_of(module: torch.nn.Module) -> _Adapter | None:
    return _active_adapter(type(module))


def _install_on_class(cls: type, adapter: _Adapter) -> None:
    current = cls.__dict__.get(adapter.method)
    if getattr(current, "__dtree_adapter__", None) is adapter:
        return
    original = getattr(cls, adapter.method)

    @functools.wraps(original)
    def dispatch(self, *args, **kwargs):
        calls = active_call()
        if calls is None:
            return original(self, *args, **kwargs)
        return adapter.replacement(self, calls, *args, **kwargs)

    dispatch.__dtree_adapter__ = adapter
    setattr(cls, adapter.method, dispatch)


def adapted_classes(model: torch.nn.Module, adapter_of: Callable) -> dict[str, tuple[type, object]]:
    """Class name -> (class, adapter) of ``model``'s modules that ``adapter_of`` adapts (also the mixers')."""
    adapters = ((type(m), adapter_of(m)) for m in model.modules())
    return {adapter.cls: (cls, adapter) for cls, adapter in adapters if adapter is not None}


def install(model: torch.nn.Module) -> list[str]:
    """Install the adapters of every adapted attention class in ``model`` (once per
    class; see the module docstring). Returns the adapted class names found. Raises a
    ``ValueError`` naming the family and the transformers versions when an adapted
    method changed in the installed transformers."""
    found = adapted_classes(model, _adapter_of)
    for cls, adapter in found.values():
        _install_on_class(cls, adapter)
    return sorted(found)


def attention_dropout(module: torch.nn.Module) -> float | None:
    """The attention-probability dropout of an adapted attention module (None for other modules)."""
    adapter = _adapter_of(module)
    return None if adapter is None else float(adapter.dropout(module))


def spec_overrides(model: torch.nn.Module, config) -> dict:
    """ModelSpec fields that differ from what the config's standard names give, for the
    adapted families: Falcon's K/V heads (multi-query: 1; new architecture:
    ``num_kv_heads``), GPT-Neo's local-attention window."""
    names = {type(m).__name__ for m in model.modules() if _adapter_of(m) is not None}
    overrides = {}
    if names & {"FalconAttention", "FalconFlashAttention2"}:
        overrides["num_kv_heads"] = _falcon_kv_heads(config)
    if names & {"GPTNeoSelfAttention", "GPTNeoFlashAttention2"} and "local" in config.attention_layers:
        overrides["sliding_window"] = config.window_size
    return overrides


def call_kwargs(adapted: list[str], device: torch.device) -> dict:
    """Extra keyword arguments of the base-model call for the adapted families: MptModel
    calls ``create_causal_mask(...).to(torch.bool)``, which fails on the None that
    transformers returns for dtree's attention; a 4D mask passed in is returned as is, so
    dtree passes a ``[1, 1, 1, 1]`` placeholder, which the MPT adapter never reads.

    Args:
        adapted: the adapted class names :func:`install` returned for the model."""
    if "MptAttention" in adapted:
        return {"attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)}
    return {}


def check(model: torch.nn.Module, name: str) -> None:
    """Refuse configurations of adapted families whose own forward dtree does not match.

    HF's eager ``FalconAttention`` with ALiBi adds the bias twice (``FalconModel`` folds
    ``alibi / sqrt(d)`` into the mask it builds, and the eager layer adds ``alibi``
    before scaling as well); its sdpa path and the original Falcon-RW add it once, as
    dtree does."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "falcon" and config.alibi and config._attn_implementation == "eager":
        raise ValueError(
            f"{name}: transformers' eager Falcon attention adds ALiBi twice (through its mask and in the layer); dtree "
            "implements ALiBi once, as its sdpa attention and the original Falcon-RW do. Load the model with "
            "attn_implementation='sdpa' (or set model.config._attn_implementation = 'sdpa')"
        )
