"""dtree's lean layers on a transformers model instance: RMSNorm and the SwiGLU MLP
through :mod:`dtree.ops.rms_norm` and :mod:`dtree.ops.swiglu`.

What a decoder layer keeps for backward decides how many tokens one model call can
hold. Per token and layer, qwen2.5-1.5b in bf16 (``benchmarks/activation_bytes.py``
measures it; ``benchmarks/PERF_NOTES.md`` has the table):

* HF's eager layers: ~99 KB: each RMSNorm keeps a float32 copy of its input, the
  normalized row and (in the next projection) its output; the MLP keeps ``gate``, its
  SiLU, ``up`` and their product (four ``[T, I]`` tensors);
* Liger's kernels (:mod:`dtree.models.fused`): ~72 KB (norms keep their input; the
  SwiGLU keeps ``gate`` and ``up``, the down projection the product);
* these lean layers: ~54 KB: the norms keep their bf16 input and one float32 per row,
  the MLP keeps ``gate`` and ``up`` only (the product is recomputed in backward, one
  elementwise pass, when the down projection is a plain ``nn.Linear``).

The kernels run in Triton on CUDA (one kernel per norm, one per activation, forward
and backward) and in torch elsewhere, with the same saved tensors.

Projections that read one input run as one autograd op
(:mod:`dtree.ops.shared_input_linear`): the MLP's gate and up, and attention's q, k and
v (:mod:`dtree.models.shared_projections`), so their input gradients are summed inside
the matmuls and their bias gradients in one launch. Their forward is the same
``F.linear`` calls.

During a step (:func:`lean_layers_during`), the attention's rotary embedding of q and k
runs through :mod:`dtree.ops.rotary` too: one kernel each way instead of HF's ~10
forward and ~20 backward launches per layer, with HF's roundings (bit for bit on the
H100). HF's attention calls ``apply_rotary_pos_emb`` as a global of its modeling module,
so that global is what the scope swaps, and puts back when it ends: the one
process-wide change here, and a harmless one (any caller during the step gets the same
values from the same function signature).

:func:`apply_lean_layers` swaps the ``forward`` of the model's own norm and MLP
modules (this instance only, nothing process-wide; :func:`remove_lean_layers` undoes
it) for the families whose modules it reproduces exactly: Llama, Qwen2, Qwen3 and
Mistral (HF's Llama-style RMSNorm; ``hidden_act="silu"``). :func:`lean_layers_during`
does the same for the length of a block: the runtime runs each of its steps inside it
(``RuntimeConfig.lean_layers``, on by default), so the model is the user's own again
between steps. Adapters stay in charge of
their modules: a LoRA-wrapped or hooked projection is called as a module (a down
projection's input, the product, is then kept as HF keeps it); only plain ``nn.Linear``
projections are folded into the shared-input op or the SwiGLU kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Iterator, Sequence

import torch

from ..ops.backward_once import backward_runs_once
from ..ops.rerun import in_rerun, rerun_chunk_rows
from ..ops.rms_norm import rms_norm
from ..ops.rotary import RotaryFunction
from ..ops.rotary.interface import rotary_supported
from ..ops.shared_input_linear import shared_input_linear
from ..ops.swiglu import silu_mul, swiglu_down
from .instance_attrs import module_attr, remove_instance_attrs, set_instance_attrs
from .plain_linear import is_plain_linear
from .shared_projections import is_shared_attention, restore_projections, swap_projections

__all__ = [
    "LeanLayers", "apply_lean_layers", "lean_layers_applied", "lean_layers_during", "lean_layers_supported",
    "lean_rotary", "remove_lean_layers",
]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_NORMS = tuple(f"{p}RMSNorm" for p in ("Llama", "Qwen2", "Qwen3", "Mistral"))
_MLPS = tuple(f"{p}MLP" for p in ("Llama", "Qwen2", "Qwen3", "Mistral"))
_SILU = ("SiLUActivation", "SiLU")


@dataclasses.dataclass(frozen=True)
class LeanLayers:
    """What :func:`apply_lean_layers` changed: the family, how many RMSNorm and MLP
    modules now run dtree's lean kernels, how many of those MLPs fold the down
    projection in (a plain ``nn.Linear``; the others call it as a module), and how many
    attention modules run their q, k, v projections as one op
    (:mod:`dtree.models.shared_projections`)."""

    model_type: str
    norms: int
    mlps: int
    fused_down: int
    rotary: bool = False
    qkv: int = 0

    def describe(self) -> str:
        return (f"dtree lean layers ({self.model_type}): RMSNorm x{self.norms}, SwiGLU MLP x{self.mlps} "
                f"({self.fused_down} with the down projection fused), q/k/v as one op x{self.qkv}"
                f"{', rotary' if self.rotary else ''}")


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # fresh outputs of one op: only the down projection's backward reads them
    fused_inputs = is_plain_linear(self.gate_proj) and is_plain_linear(self.up_proj)
    if fused_inputs:  # one backward node: dx summed in the matmuls
        gate, up = shared_input_linear(x, ((self.gate_proj.weight, self.gate_proj.bias),
                                           (self.up_proj.weight, self.up_proj.bias)))
    else:
        gate, up = self.gate_proj(x), self.up_proj(x)
    down = self.down_proj
    if is_plain_linear(down):
        if in_rerun():  # only the residual add reads the output
            return swiglu_down(gate, up, down.weight, down.bias, output_unused=True, chunk_rows=rerun_chunk_rows())
        # a step's graph (dtree.ops.backward_once): gradients over gate and up, in one chunk
        owned = fused_inputs and backward_runs_once()
        return swiglu_down(gate, up, down.weight, down.bias, inputs_owned=owned, chunk_rows=0 if owned else None)
    return down(silu_mul(gate, up))


_ROTARY_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")


@functools.cache
def _lean_rotary(original):
    """``original`` (HF's ``apply_rotary_pos_emb``) through :mod:`dtree.ops.rotary` where it
    takes the inputs, else ``original`` itself; opaque to ``torch.compile``."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if unsqueeze_dim == 1 and rotary_supported(q, k, cos, sin):
            return RotaryFunction.apply(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._dtree_lean = True
    return torch.compiler.disable(apply_rotary_pos_emb)


@contextlib.contextmanager
def _swapped_rotary(attention: torch.nn.Module | None) -> Iterator[types.ModuleType | None]:
    """dtree's rotary in ``attention``'s modeling module for the block (yields the module,
    or None where it changes nothing), HF's function back after it, also on errors."""
    module = _rotary_module(attention)
    if module is None:
        yield None
        return
    original = module.apply_rotary_pos_emb
    module.apply_rotary_pos_emb = _lean_rotary(original)
    try:
        yield module
    finally:
        if getattr(module.apply_rotary_pos_emb, "_dtree_lean", False):
            module.apply_rotary_pos_emb = original


def _first_attention(model: torch.nn.Module) -> torch.nn.Module | None:
    return next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)


@contextlib.contextmanager
def lean_rotary(model: torch.nn.Module) -> Iterator[str | None]:
    """dtree's rotary kernel for every model of ``model``'s family in the process, for the
    length of the block: what ``dtree bench`` gives every method alongside the lean layers
    (the runtime's own scope, :func:`lean_layers_during`, does it per step). Yields the
    modeling module's name, or None where the family's ``apply_rotary_pos_emb`` is not
    HF's (or is already dtree's)."""
    if _model_type(model) not in FAMILIES:
        yield None
        return
    with _swapped_rotary(_first_attention(model)) as module:
        yield None if module is None else module.__name__


def _rotary_module(attention: torch.nn.Module | None) -> types.ModuleType | None:
    """The modeling module whose global ``apply_rotary_pos_emb`` (HF's signature, not
    already dtree's) ``attention`` calls, or None."""
    module = sys.modules.get(type(attention).__module__) if attention is not None else None
    fn = getattr(module, "apply_rotary_pos_emb", None)
    if fn is None or getattr(fn, "_dtree_lean", False) or not callable(fn):
        return None
    try:
        rotary = _takes_rotary_arguments(fn)  # read once per function: the scope asks at every step
    except TypeError:  # an unhashable callable
        rotary = _takes_rotary_arguments.__wrapped__(fn)
    return module if rotary else None


@functools.lru_cache(maxsize=32)
def _takes_rotary_arguments(fn) -> bool:
    """``fn``'s parameters are HF's ``apply_rotary_pos_emb``'s (``inspect.signature`` costs ~0.1 ms)."""
    try:
        return tuple(inspect.signature(fn).parameters) == _ROTARY_PARAMETERS
    except (TypeError, ValueError):
        return False


def _model_type(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "model_type", None)


def _is_norm(m: torch.nn.Module) -> bool:
    return (type(m).__name__ in _NORMS and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float))


def _is_mlp(m: torch.nn.Module) -> bool:
    return (type(m).__name__ in _MLPS and type(getattr(m, "act_fn", None)).__name__ in _SILU
            and all(isinstance(getattr(m, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj")))


def _targets(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module], list[torch.nn.Module]]:
    """(the model's Llama-style RMSNorm modules, its SiLU-gated MLP modules, its attention
    modules whose q, k, v projections can run as one op)."""
    modules = list(model.modules())
    return ([m for m in modules if _is_norm(m)], [m for m in modules if _is_mlp(m)],
            [m for m in modules if is_shared_attention(m)])


def lean_layers_supported(model: torch.nn.Module) -> bool:
    """Whether :func:`apply_lean_layers` takes ``model`` (a supported family with layers
    it recognizes)."""
    if _model_type(model) not in FAMILIES:
        return False
    norms, mlps, _ = _targets(model)
    return bool(norms or mlps)


def lean_layers_applied(model: torch.nn.Module) -> bool:
    return any(getattr(m, "_dtree_lean", False) for m in model.modules())


def apply_lean_layers(model: torch.nn.Module) -> LeanLayers:
    """Run ``model``'s RMSNorm and SwiGLU MLP modules through dtree's lean kernels (see
    the module docstring), in place; applying twice is a no-op.

    Args:
        model: a transformers Llama, Qwen2, Qwen3 or Mistral model (the base model or
            ``*ForCausalLM``; apply it before PEFT wrapping or compilation).

    Raises:
        ValueError: another family (names the supported ones), or no module to change.
    """
    model_type = _model_type(model)
    if model_type not in FAMILIES:
        raise ValueError(
            f"dtree's lean layers reproduce the norms and MLPs of {', '.join(FAMILIES)} exactly; this model's "
            f"model_type is {model_type!r}: run it with its own layers (or Liger's: dtree.models.fused)"
        )
    norms, mlps, attentions = _targets(model)
    if not norms and not mlps:
        raise ValueError(f"{type(model).__name__}: no {'/'.join(_NORMS)} or SiLU {'/'.join(_MLPS)} module to replace")
    return _swap(model_type, norms, mlps, attentions)[0]


@functools.cache
def _forwards() -> tuple:
    """The lean forwards, opaque to ``torch.compile``: a compiled layer calls them
    eagerly (a graph break) instead of tracing their Triton launches, which dynamo fails
    on with dynamic shapes (H100, torch 2.11: ``'SymNodeVariable' object has no attribute
    'value'``). Built at the first swap, so importing this module imports no dynamo."""
    return torch.compiler.disable(_norm_forward), torch.compiler.disable(_mlp_forward)


def _swap(
    model_type: str, norms: list[torch.nn.Module], mlps: list[torch.nn.Module], attentions: list[torch.nn.Module]
) -> tuple[LeanLayers, list[torch.nn.Module]]:
    """Swap the modules' forwards; returns what changed and every module swapped."""
    norm_forward, mlp_forward = _forwards()
    for m in norms:
        set_instance_attrs(m, forward=types.MethodType(norm_forward, m), _dtree_lean=True)
    for m in mlps:
        set_instance_attrs(m, forward=types.MethodType(mlp_forward, m), _dtree_lean=True)
    fused_down = sum(is_plain_linear(m.down_proj) for m in mlps)
    projections = swap_projections(attentions)
    return LeanLayers(model_type, len(norms), len(mlps), fused_down, qkv=len(attentions)), norms + mlps + projections


def _restore(modules: list[torch.nn.Module]) -> None:
    restore_projections([m for m in modules if "_dtree_handover" in m.__dict__])  # set there by swap_projections
    for m in modules:
        if "forward" in vars(m):  # the norms and MLPs (the projections are back already)
            remove_instance_attrs(m, "forward", "_dtree_lean")


def remove_lean_layers(model: torch.nn.Module) -> None:
    """Undo :func:`apply_lean_layers` on ``model``."""
    _restore([m for m in model.modules() if getattr(m, "_dtree_lean", False)])


def _compiled(m: torch.nn.Module) -> bool:
    """Whether module ``m`` runs through ``torch.compile`` (a swapped ``forward`` in it
    would only make it recompile): compiled by dtree or by ``Module.compile``, or a
    ``torch.compile`` wrapper (its ``_orig_mod`` submodule)."""
    return bool(module_attr(m, "_dtree_compiled", False)) or module_attr(m, "_compiled_call_impl") is not None \
        or "_orig_mod" in m._modules


@contextlib.contextmanager
def lean_layers_during(
    model: torch.nn.Module, enabled: bool = True, modules: Sequence[torch.nn.Module] | None = None
) -> Iterator[LeanLayers | None]:
    """:func:`apply_lean_layers` for the length of the block, then the modules' own
    ``forward`` again (also when the block raises). A module whose ``forward`` is
    already patched on the instance (the user's own, or another library's) keeps it.
    Yields what it changed, or None where it changes nothing: ``enabled`` False, a family
    it does not reproduce, lean layers already applied (by the caller, who keeps them),
    compiled modules, or nothing left unpatched. ``modules``: ``model.modules()``, when the
    caller walked them already."""
    model_type = _model_type(model)
    if not enabled or model_type not in FAMILIES:
        yield None
        return
    norms, mlps, attentions, attention = [], [], [], None
    for m in model.modules() if modules is None else modules:  # once: this runs at every step
        if module_attr(m, "_dtree_lean", False) or _compiled(m):
            yield None
            return
        if "forward" not in vars(m):
            (norms if _is_norm(m) else mlps if _is_mlp(m) else attentions if is_shared_attention(m) else []).append(m)
        if attention is None and type(m).__name__.endswith("Attention"):
            attention = m
    if not norms and not mlps:
        yield None
        return
    applied, swapped = _swap(model_type, norms, mlps, attentions)
    try:
        with _swapped_rotary(attention) as module:
            yield applied if module is None else dataclasses.replace(applied, rotary=True)
    finally:
        _restore(swapped)
