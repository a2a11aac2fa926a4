"""A one-time probe of a transformers model: does dtree compute what the model computes?

dtree runs a model's decoder through :meth:`HFTreeModel.dtree_hidden_states` with its
own attention, and its LM head through an :class:`~dtree.ops.logprobs.OutputHead`
built from the config. Whatever the model does beyond that (a logit transform in its
``*ForCausalLM.forward``, tokens mixed outside attention, positions taken from the row
instead of ``position_ids``) would make dtree silently wrong. :func:`check_model`
catches it on a short probe, against the model's own ``forward`` with its own attention:

1. **alone**: the log-probs (and entropies) of the model's own logits equal those of
   dtree's ``OutputHead`` applied to dtree's hidden states of the probe sequence
   (attention by :func:`dtree.ops.stack_attention.attend_math`, the ops' reference
   math). When they differ, the hidden states the model's base returned tell which
   part is off: the head (Granite's ``logits_scaling``, Cohere's ``logit_scale``,
   Gemma's final soft-capping are configured; anything else is refused) or the decoder;
2. **packed**: dtree's hidden states of the probe sequence packed after another one in
   one call, as the runtime packs segments, equal those of the probe alone: a
   recurrent or convolution layer without dtree's adapter, or a model that ignores
   ``position_ids``, leaks the first sequence into the second;
3. **split** (models with recurrent layers): the probe sequence run as a branch point,
   its first tokens in one call that leaves its K/V and recurrent states on the stacks
   and the rest in a second call that starts from them, equals the sequence alone: a
   mixer adapter that mishandles a state it takes or gives is caught on the model at
   hand.

The model's own forward runs with its own attention implementation even inside
:meth:`HFTreeModel.dtree_scope` (:meth:`HFTreeModel.own_attention`).

It runs without grad, in eval mode (dropout off; the modules' modes are restored), once
per model placement and head (see :meth:`HFTreeModel.dtree_output_layer`). A mismatch
raises a ``ValueError`` naming the model class and what differs. Tolerances are
relative to the reference's size: 1e-4 in float32 (exact runs agree to about 1e-6),
5e-2 in 16-bit dtypes, where the probe catches gross errors only and
``tests/test_families.py`` checks every family in float32.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Protocol

import numpy as np
import torch

from ..ops.logprobs import OutputHead, token_logprobs_reference
from ..ops.segment_states import LayerStates, StateLayout
from ..ops.stack_attention import AttentionOptions, attend_math
from .protocol import AttendFn, ModelSpec

__all__ = ["check_model", "PROBE_LENGTHS"]

PROBE_LENGTHS = (5, 7)  # the packed-before sequence, the probe sequence

_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}
_TOLERANCE_16BIT = 5e-2


class ProbedModel(Protocol):
    """What the probe reads of a model's adapter (:class:`dtree.models.hf.HFTreeModel`)."""

    model: torch.nn.Module  # the ``*ForCausalLM``
    base: torch.nn.Module  # its base model, whose output is what dtree's head is applied to
    name: str
    spec: ModelSpec

    def dtree_hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor: ...

    def own_attention(self) -> ContextManager[None]: ...

    def head_transform(self) -> str: ...

    def mixer_hint(self) -> str: ...


class SplitAttention:
    """``attend`` for the split probe: one segment at stack slots ``[lo, lo + T)`` whose
    ancestors' K/V (slots ``[0, lo)``) and recurrent states (state slot 0) are on
    ``stacks``; it pushes its own K/V, and its final states when ``push_state``."""

    def __init__(self, stacks, lo: int, length: int, push_state: bool) -> None:
        from ..ops.stack_attention import SegmentLayout

        self.stacks, self.lo = stacks, lo
        self.layout = SegmentLayout(np.array([0, length]), np.array([lo]), [((0, lo),) if lo else ()])
        one = np.array([-1], dtype=np.int64)
        self.states_layout = StateLayout(
            np.array([0, length]), one, np.array([0 if lo else -1]), np.array([0 if push_state else -1])
        )

    def __call__(self, layer: int, q, k, v, scale: float, **options) -> torch.Tensor:
        from ..ops.stack_attention import StackSlots, stack_attention

        stack, local = self.stacks.kv_of(layer)
        stack.push(local, self.lo, k, v)
        slots = StackSlots(stack, local, self.layout)
        return stack_attention(q, k, v, slots, AttentionOptions(scale=scale, **options), "reference")

    def states(self, layer: int) -> LayerStates:
        return LayerStates(self.states_layout, self.stacks.states, layer)


def _split_hidden(adapter: ProbedModel, ids: torch.Tensor, at: int) -> torch.Tensor:
    """[T, hidden]: ``ids[:at]`` in one call, ``ids[at:]`` in a second one that starts
    from the first one's K/V and recurrent states (see :class:`SplitAttention`)."""
    from ..stacks.step_stacks import StepStacks

    param = next(adapter.model.parameters())
    stacks = StepStacks(adapter.spec, len(ids), 1, dtype=param.dtype, device=ids.device, with_grad=False)
    positions = torch.arange(len(ids), device=ids.device)
    first = adapter.dtree_hidden_states(ids[:at], positions[:at], SplitAttention(stacks, 0, at, True))
    rest = adapter.dtree_hidden_states(ids[at:], positions[at:], SplitAttention(stacks, at, len(ids) - at, False))
    return torch.cat([first, rest])


class SegmentAttention:
    """``attend`` for the probe: plain per-segment causal attention (no stack), each
    segment on its own, with the layer's options. q [T, Hq, Dk], k [T, Hkv, Dk],
    v [T, Hkv, Dv] -> [T, Hq, Dv]. Recurrent layers start every segment from zeros
    (:meth:`states`)."""

    def __init__(self, lengths: list[int]) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        self.layout = StateLayout.roots(self.offsets)

    def states(self, layer: int) -> LayerStates:
        return LayerStates(self.layout, None, layer)

    def __call__(self, layer: int, q, k, v, scale: float, **options) -> torch.Tensor:
        opts = AttentionOptions(**options)
        parts = [
            attend_math(q[a:b], k[a:b], v[a:b], scale, opts) for a, b in zip(self.offsets[:-1], self.offsets[1:])
        ]
        return torch.cat(parts)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def _probe_tokens(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two fixed token sequences of :data:`PROBE_LENGTHS`, ids in ``[0, min(vocab, 1000))``."""
    gen = torch.Generator().manual_seed(1234)
    first, probe = (torch.randint(0, min(vocab, 1000), (n,), generator=gen) for n in PROBE_LENGTHS)
    return first.to(device), probe.to(device)


def _own_forward(adapter: ProbedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own forward on one row: ([T, V] logits, [T, H] hidden states its
    base model returned, i.e. what dtree's head is applied to; None when the forward
    does not call the base model as a whole, e.g. OPT calls its decoder)."""
    seen: list[torch.Tensor] = []

    def grab(module, args, output):
        hidden = getattr(output, "last_hidden_state", None)
        seen.append(hidden if hidden is not None else output[0])

    # accelerate's mixed precision wraps forward in autocast (keeping the original as
    # _original_forward): the probe compares in the model's own dtype, so it calls the original
    forward = getattr(adapter.model, "_original_forward", adapter.model)
    handle = adapter.base.register_forward_hook(grab)
    try:
        with adapter.own_attention():
            out = forward(input_ids=ids[None], use_cache=False)
    finally:
        handle.remove()
    return out.logits[0], (seen[-1][0] if seen else None)


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))


def _tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCE.get(dtype, _TOLERANCE_16BIT)


def _head_error(head: OutputHead, logits: torch.Tensor, hidden: torch.Tensor, ids) -> tuple[float, float]:
    """(relative error, max abs difference) between the log-probs and entropies of the
    model's logits and those of dtree's head on ``hidden``: three labels per row (the
    next probe token, the model's most and least likely)."""
    labels = torch.stack([torch.roll(ids, -1), logits.argmax(-1), logits.argmin(-1)], dim=1).reshape(-1)
    lp, ent = token_logprobs_reference(hidden.repeat_interleave(3, dim=0), head, labels, with_entropy=True)
    ref_all = torch.log_softmax(logits.to(lp.dtype), dim=-1)
    ref_lp = ref_all.repeat_interleave(3, dim=0).gather(-1, labels[:, None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1).repeat_interleave(3)
    err = max(_relative_error(lp, ref_lp), _relative_error(ent, ref_ent))
    return err, float((lp - ref_lp).abs().max())


def check_model(adapter: ProbedModel, head: OutputHead) -> None:
    """Raise a ValueError if dtree's view of ``adapter``'s model differs from the model's
    own forward on the probe (see the module docstring)."""
    model = adapter.model
    device = next(model.parameters()).device
    first, ids = _probe_tokens(adapter.spec.vocab_size, device)
    n0, n = len(first), len(ids)
    # in the model's own dtype even when the caller runs under autocast: the probe checks
    # what is computed, at the tightest tolerance the dtype allows
    with torch.no_grad(), _eval_mode(model), torch.autocast(device.type, enabled=False):
        logits, base_hidden = _own_forward(adapter, ids)
        tol = _tolerance(next(model.parameters()).dtype)  # some models upcast their logits
        positions = torch.arange(n, device=device)
        alone = adapter.dtree_hidden_states(ids, positions, SegmentAttention([n]))
        err, diff = _head_error(head, logits, alone, ids)
        if err > tol:
            if base_hidden is not None and _head_error(head, logits, base_hidden, ids)[0] > tol:
                raise ValueError(
                    f"{adapter.name} post-processes its logits (or the hidden states before its LM head) in forward: "
                    f"its log-probs differ from its LM head's by up to {diff:.3g} (relative {err:.2e}); dtree cannot "
                    f"reproduce it. dtree applies {adapter.head_transform()} from the config; another transform needs "
                    "a custom TreeModule with its own OutputHead (logit_scale, final_softcap)"
                )
            raise ValueError(
                f"{adapter.name}: dtree's log-probs of a probe sequence differ from the model's own forward by up to "
                f"{diff:.3g} (relative {err:.2e}): its attention computes something dtree's attention options do not "
                f"express, or another part of the model depends on how it is called{adapter.mixer_hint()}. dtree "
                "cannot run it exactly"
            )
        packed = adapter.dtree_hidden_states(
            torch.cat([first, ids]), torch.cat([torch.arange(n0, device=device), positions]),
            SegmentAttention([n0, n]),
        )[n0:]
        err = _relative_error(packed, alone)
        if err > tol:
            raise ValueError(
                f"{adapter.name}: dtree's forward of a probe sequence packed after another one differs from the same "
                f"sequence alone (relative error {err:.2e}): something mixes tokens outside the attention function "
                f"(a recurrent, state-space or convolution layer), or the model ignores position_ids"
                f"{adapter.mixer_hint()}. dtree packs sequences and splits them at tree branches, so it cannot run "
                "this model exactly"
            )
        if adapter.spec.recurrent_states:
            err = _relative_error(_split_hidden(adapter, ids, 3), alone)
            if err > tol:
                raise ValueError(
                    f"{adapter.name}: dtree's forward of a probe sequence split at a branch point (the second part "
                    f"starting from the first part's K/V and recurrent states) differs from the sequence alone "
                    f"(relative error {err:.2e}): a recurrent layer's adapter mishandles its states"
                    f"{adapter.mixer_hint()}; dtree cannot run this model exactly"
                )
