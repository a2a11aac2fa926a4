"""Fused layer kernels from Liger-Kernel on a transformers model instance.

Optional extra: ``pip install 'dtree[fused]'`` (``liger-kernel``). One call,
:func:`apply_fused_kernels`, for every model family Liger-Kernel supports (its
``MODEL_TYPE_TO_APPLY_LIGER_FN``, keyed by ``config.model_type``: Llama, Mistral, Qwen2/3,
Gemma 1-3, Phi-3, Granite, OLMo2, ...) through Liger's own instance entry point, so dtree
holds no per-family code. It replaces, per family as Liger decides:

* RMSNorm (and LayerNorm where the family has it) with Liger's Triton kernel;
* the gated MLP with Liger's fused SwiGLU / GeGLU / ReLU^2 activation (the three
  projections stay cuBLAS matmuls);
* ``apply_rotary_pos_emb`` with Liger's in-place Triton rotary, for the families where
  Liger enables it by default.

Never: Liger's cross-entropy or fused linear cross-entropy (dtree computes log-probs with
its own LM-head op, and the model's ``forward`` is not used), and nothing inside
attention (dtree's attention function stays in charge of the KV stack).

Exactness (checked against Liger 0.8.5's source and by ``tests/test_fused.py``):

* Rotary: Liger's kernel reads one ``cos``/``sin`` row per token, the rows the model's
  rotary embedding computed from the ``position_ids`` it was given, and ignores its own
  ``position_ids`` argument. Tree depths, packed rows whose positions restart, batch 1:
  all fine.
* RMSNorm: Liger's ``casting_mode="llama"`` is HF's Llama-style norm (mean of squares and
  ``rsqrt`` in float32, the normalized row cast back to the input dtype before the weight
  multiply) and ``"gemma"`` is Gemma's (everything in float32, ``1 + weight``, cast at the
  end); the family's ``eps`` is kept. The only differences are float32 summation order
  and the hardware ``rsqrt``: float32 rounding, within the bf16 test rule on GPU and
  ~1e-7 on CPU.
* SwiGLU: ``silu`` in float32, cast to the model dtype, times ``up``: HF's two roundings.
* The backward kernels write their results into buffers they no longer need (RMSNorm:
  into the incoming gradient; SwiGLU: into its saved inputs), so a graph through patched
  layers can be backpropagated once only. dtree never retains a graph for a second
  backward.

Process-wide effects (Liger patches the family's transformers modeling module, not only
the instance): the rotary function is replaced for every model of that family in this
process, and models of that family constructed later get Liger's norm/MLP classes. The
returned :class:`FusedKernels` lists those names. Apply it to the base transformers model
(before wrapping it in PEFT or ``torch.compile``), on CUDA: Liger's kernels are Triton.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

__all__ = ["FusedKernels", "apply_fused_kernels", "fused_kernels_available"]

_INSTALL = "pip install liger-kernel (or pip install 'dtree[fused]')"

# Liger's per-family switches, by what they fuse. A switch is turned on only where the
# family's own default is on: Liger leaves e.g. its rotary off for families whose rotary
# it does not reproduce (DeepSeek, GLM-4, Qwen3.5, ...).
_NORM_FLAGS = ("rms_norm", "layer_norm")
_MLP_FLAGS = ("swiglu", "geglu", "relu_squared")
_ROPE_FLAGS = ("rope",)
_ALWAYS_OFF = ("cross_entropy", "fused_linear_cross_entropy")


@dataclass(frozen=True)
class FusedKernels:
    """What :func:`apply_fused_kernels` changed.

    Attributes:
        model_type: the config's ``model_type``.
        modules: Liger module name -> how many of the model's modules now run it
            (e.g. ``{"LigerRMSNorm": 57, "LigerSwiGLUMLP": 28}``).
        module_globals: names Liger replaced in the family's transformers modeling module
            (process-wide), e.g. ``("Qwen2MLP", "Qwen2RMSNorm", "apply_rotary_pos_emb")``.
    """

    model_type: str
    modules: dict[str, int] = field(default_factory=dict)
    module_globals: tuple[str, ...] = ()


def fused_kernels_available() -> bool:
    """Whether Liger-Kernel can be imported."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _liger_apply_functions() -> dict:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        raise ImportError(f"fused layer kernels need Liger-Kernel: {_INSTALL}") from e
    return MODEL_TYPE_TO_APPLY_LIGER_FN


def _switches(apply_fn, rms_norm: bool, rope: bool, mlp: bool) -> dict[str, bool]:
    """Keyword arguments for one family's ``apply_liger_kernel_to_*``: each switch it has
    on where the family default and the caller both want it, the loss kernels off."""
    params = inspect.signature(apply_fn).parameters
    wanted = {**dict.fromkeys(_NORM_FLAGS, rms_norm), **dict.fromkeys(_MLP_FLAGS, mlp), **dict.fromkeys(_ROPE_FLAGS, rope)}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        # a multimodal wrapper forwarding to its text/vision families, which keep their
        # own defaults for what is wanted and drop the switches they do not have
        return {**{name: False for name, want in wanted.items() if not want}, **dict.fromkeys(_ALWAYS_OFF, False)}
    kwargs = {name: bool(want and params[name].default is True) for name, want in wanted.items() if name in params}
    kwargs.update({name: False for name in _ALWAYS_OFF if name in params})
    return kwargs


def apply_fused_kernels(model: torch.nn.Module, *, rms_norm: bool = True, rope: bool = True, mlp: bool = True) -> FusedKernels:
    """Replace the norms, rotary and MLP activation of a transformers model with Liger's
    Triton kernels, in place (see the module docstring for what, and its process-wide
    effects).

    Args:
        model: a transformers model (``PreTrainedModel`` with ``config.model_type``), e.g.
            ``Qwen2ForCausalLM``, before PEFT wrapping or compilation.
        rms_norm, rope, mlp: which kinds of kernels to apply (each only where Liger
            applies it to the family by default).

    Returns:
        :class:`FusedKernels`: the modules and module globals that changed.

    Raises:
        ImportError: Liger-Kernel is not installed (names the install command).
        ValueError: the model has no ``config.model_type``, or Liger has no kernels for it.
    """
    apply_fns = _liger_apply_functions()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        raise ValueError(
            f"apply_fused_kernels needs a transformers model with config.model_type, got {type(model).__name__}; "
            "pass the transformers model itself (not a PEFT or dtree wrapper)"
        )
    if model_type not in apply_fns:
        raise ValueError(
            f"Liger-Kernel has no kernels for model_type {model_type!r}; supported: {', '.join(sorted(apply_fns))}. "
            "Run without fused kernels"
        )
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    modeling = sys.modules.get(type(model).__module__)
    before = dict(vars(modeling)) if modeling is not None else {}
    _apply_liger_kernel_to_instance(model, **_switches(apply_fns[model_type], rms_norm, rope, mlp))
    changed = tuple(
        sorted(name for name, value in vars(modeling).items() if before.get(name) is not value)
    ) if modeling is not None else ()
    modules = Counter(m._get_name() for m in model.modules() if m._get_name().startswith("Liger"))
    return FusedKernels(model_type, dict(modules), changed)
