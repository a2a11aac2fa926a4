"""The linearized baseline: every sequence computed on its own, packed varlen.

This is what verl, OpenRLHF and TRL do today ("remove padding" + flash-attn varlen):
sequences are concatenated into one row with no padding, position ids restart at 0 for
each sequence, and attention is causal within each sequence
(:mod:`dtree.baselines.kernels.varlen_attention`). Shared prefixes are recomputed in every sequence
that contains them, in forward and backward.

Micro-batches take whole sequences, in input order, while their total stays within
``max_tokens_per_batch``; a sequence longer than the budget runs alone. Gradients
accumulate over micro-batches (see :mod:`dtree.baselines.step`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..forest.forest import Forest
from ..models import AttendFn
from ..ops.segment_states import LayerStates, StateLayout
from .kernels.varlen_attention import VarlenLayout
from .kernels.varlen_interface import BACKENDS, varlen_attention
from .step import MicroBatch, MicroBatchTrainer, pack_in_order

__all__ = ["LinearizedTrainer"]


class LinearizedTrainer(MicroBatchTrainer):
    """Linearized training with packed varlen micro-batches.

    Args:
        model: a transformers causal LM or a :class:`dtree.models.TreeModule`.
        max_tokens_per_batch: token budget of one micro-batch (one model call).
        attention: ``"auto"`` (on CUDA in 16 bits: ``flash-attn``, the flash-attn
            package's ``flash_attn_varlen_func`` as verl and OpenRLHF run it, when it is
            installed; else ``flash``, torch's ``varlen_attn``, when it runs for this
            model's head shapes; else ``sdpa``), ``"flash-attn"``, ``"flash"``,
            ``"sdpa"`` or ``"reference"`` (see :mod:`dtree.baselines.kernels.varlen_attention`).
        logprob_chunk: rows per chunk of the LM head (memory O(chunk x vocab)); the same
            chunked log-probs as :class:`dtree.TreeRuntime`, so no method materializes
            ``[tokens, vocab]`` logits.
        checkpoint: checkpoint every decoder layer (dtree's per-layer checkpointing, see
            :mod:`dtree.models.checkpointing`): activation memory falls to one
            ``[T, hidden]`` input per layer plus one layer's internals, for about one
            extra forward.
        rerun_chunk_rows: with ``checkpoint``, the rows per chunk of a re-run layer's SwiGLU
            backward (:func:`dtree.ops.swiglu.swiglu_down`; 0: the whole micro-batch at once,
            None: the op's own, 4,096).
        grad_guard: a failed step leaves ``param.grad`` as it was (as the runtime's
            option, :mod:`dtree.engine.grad_guard`; ``"host"``: the old gradients kept in
            pinned host memory); False accumulates in place, as the
            trainers this baseline stands for do.
        weight_grads_in_matmul: as the runtime's option (:mod:`dtree.ops.weight_grads`): the lean
            layers' projections add each micro-batch's weight gradients into ``param.grad`` in their
            matmuls.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_tokens_per_batch: int = 16384,
        attention: str = "auto",
        logprob_chunk: int = 4096,
        checkpoint: bool = False,
        grad_guard: bool | str = True,
        rerun_chunk_rows: int | None = None,
        weight_grads_in_matmul: bool = True,
    ) -> None:
        super().__init__(model, logprob_chunk, checkpoint, grad_guard, rerun_chunk_rows, weight_grads_in_matmul)
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
        self.max_tokens_per_batch = max_tokens_per_batch
        self.attention = self._pick_backend(attention)

    def _pick_backend(self, attention: str) -> str:
        spec = self.spec
        shapes = dict(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
        return BACKENDS.resolve(attention, self.device, self.dtype, **shapes)

    def plan(self, forest: Forest) -> list[MicroBatch]:
        """One :class:`MicroBatch` per packed range of sequences."""
        lengths = forest.sequence_lengths()
        offsets = forest.seq_offsets
        batches = []
        for first, end in pack_in_order(lengths, self.max_tokens_per_batch):
            lo, hi = int(offsets[first]), int(offsets[end])
            cu = offsets[first : end + 1] - lo
            positions = np.arange(hi - lo) - np.repeat(cu[:-1], lengths[first:end])
            predicted = np.flatnonzero(positions > 0)  # rows after each sequence's first token
            batches.append(
                MicroBatch(
                    row_unique=forest.lin_unique[lo:hi],
                    position_ids=positions,
                    term_lin=lo + predicted,
                    term_row=predicted - 1,
                    term_target=predicted,
                    layout=VarlenLayout(cu),
                )
            )
        return batches

    def _attend(self, layout: VarlenLayout) -> AttendFn:
        return _VarlenAttend(layout, self.attention, self.recurrence)


class _VarlenAttend:
    """Causal attention within each packed sequence; a recurrent layer starts each
    sequence from zeros (:meth:`states`), as it does on a sequence alone."""

    def __init__(self, layout: VarlenLayout, backend: str, recurrence: str | None) -> None:
        self.layout, self.backend, self.recurrence = layout, backend, recurrence
        self.state_layout = StateLayout.roots(layout.cu_seqlens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return varlen_attention(q, k, v, self.layout, scale, self.backend)

    def states(self, layer: int) -> LayerStates:
        return LayerStates(self.state_layout, None, layer, backend=self.recurrence or "reference")
