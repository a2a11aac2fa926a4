"""The tree-mask baseline: each tree packed into one sequence under a tree attention mask.

This is AReaL's "sparse" mode and the Tree Training paper's Tree Packing. A tree's
unique tokens go through the model once, as one row in depth-first order (the forest's
unique-token order), with position ids = depths and the mask "key j is an ancestor of
query i, or i itself", which in that order is the interval test
``j <= i < subtree_end(j)`` (:mod:`dtree.baselines.kernels.tree_mask_attention`). Autograd through the
packed row sums every path's gradient into the shared prefix: one forward and one
backward per micro-batch. Each unique token is computed once, but activation memory
grows with the row, and the mask costs build time and sparsity overhead.

Loss terms: a linearized prediction ``s[t]`` reads the log-prob of its unique token,
predicted by the row of that token's predecessor (``Forest.predecessor``); terms that share
a unique token share one LM-head row, as in :class:`dtree.TreeRuntime`.

Micro-batches (``max_tokens_per_batch``): whole trees are packed side by side into rows
of at most that many tokens (the mask keeps them apart). A tree larger than the budget is
split the way AReaL does it: its sequences, in depth-first order, are grouped greedily
while the group's own trie fits the budget (so sequences sharing long prefixes stay
together), and each group is re-packed as a tree of its own; the shared prefix is
recomputed in every group. ``StepOutput.metrics`` reports the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..forest.forest import Forest
from ..models import AttendFn
from .kernels.tree_mask_attention import BACKENDS, TreeMaskLayout, tree_mask_attention
from .step import MicroBatch, MicroBatchTrainer, pack_in_order

__all__ = ["TreeMaskTrainer", "split_tree", "token_subtree_end"]


def token_subtree_end(forest: Forest) -> np.ndarray:
    """[U] for every unique token, the end (exclusive, in unique-token order) of its
    node's subtree: the token's descendants are the tokens ``[u, end[u])``."""
    node_end = np.append(forest.node_start, forest.num_unique_tokens)[forest.node_subtree_end]
    return np.repeat(node_end, forest.node_length)


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(starts, stops)])``, vectorized."""
    lengths = stops - starts
    first = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(int(lengths.sum())) + first


@dataclass
class _Unit:
    """A (sub-)tree run as one block of a row: ``tokens`` (sorted unique-token indices,
    closed under ancestors) and the sequences whose loss terms it computes."""

    tokens: np.ndarray
    sequences: np.ndarray


def _common_prefix(forest: Forest, a: int, b: int) -> int:
    ua = forest.lin_unique[forest.seq_offsets[a] : forest.seq_offsets[a + 1]]
    ub = forest.lin_unique[forest.seq_offsets[b] : forest.seq_offsets[b + 1]]
    m = min(len(ua), len(ub))
    differ = np.flatnonzero(ua[:m] != ub[:m])
    return int(differ[0]) if differ.size else m


def split_tree(forest: Forest, sequences: np.ndarray, budget: int) -> list[np.ndarray]:
    """Group one tree's sequences so that each group's trie has at most ``budget`` tokens
    (a single longer sequence makes a group of its own).

    Sequences are taken in depth-first order (by the unique index of their last token),
    where each one shares the most with the one before it, so the trie of a group grows
    by ``len(s) - common_prefix(previous, s)`` per sequence.
    """
    lengths = forest.sequence_lengths()
    last = forest.lin_unique[forest.seq_offsets[sequences + 1] - 1]
    order = sequences[np.argsort(last, kind="stable")]
    groups: list[list[int]] = [[int(order[0])]]
    size = int(lengths[order[0]])
    for prev, s in zip(order[:-1].tolist(), order[1:].tolist()):
        grow = int(lengths[s]) - _common_prefix(forest, prev, s)
        if size + grow > budget:
            groups.append([s])
            size = int(lengths[s])
        else:
            groups[-1].append(s)
            size += grow
    return [np.array(g, dtype=np.int64) for g in groups]


class TreeMaskTrainer(MicroBatchTrainer):
    """Tree packing with a tree attention mask.

    Args:
        model: a transformers causal LM or a :class:`dtree.models.TreeModule`.
        max_tokens_per_batch: token budget of one row; larger trees are split (see the
            module docstring). None packs the whole forest into one row.
        attention: ``"auto"`` (``flex`` on CUDA, else ``sdpa``), ``"flex"`` (CUDA only:
            FlexAttention has no CPU backward) or ``"sdpa"`` (dense ``[N, N]`` mask).
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
        max_tokens_per_batch: int | None = None,
        attention: str = "auto",
        logprob_chunk: int = 4096,
        checkpoint: bool = False,
        grad_guard: bool | str = True,
        rerun_chunk_rows: int | None = None,
        weight_grads_in_matmul: bool = True,
    ) -> None:
        super().__init__(model, logprob_chunk, checkpoint, grad_guard, rerun_chunk_rows, weight_grads_in_matmul)
        if self.spec.recurrent_states:
            raise ValueError(
                f"{self.spec.name} has recurrent layers (layers {list(self.spec.recurrent_layers)}): tree-mask training "
                "cannot express them (a mask removes keys from attention, but a recurrent state flows through every "
                "earlier token of the packed row); train it with dtree.TreeRuntime or the linearized baseline"
            )
        if max_tokens_per_batch is not None and max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be None or >= 1, got {max_tokens_per_batch}")
        self.max_tokens_per_batch = max_tokens_per_batch
        self.attention = BACKENDS.resolve(attention, self.device)

    def _units(self, forest: Forest) -> list[_Unit]:
        """Whole trees, or the groups of the trees larger than the budget, tree by tree."""
        tree_start = forest.node_start[forest.tree_roots]
        tree_end = np.append(tree_start[1:], forest.num_unique_tokens)
        seq_tree = forest.sequence_tree()
        by_tree = np.split(np.argsort(seq_tree, kind="stable"), np.cumsum(np.bincount(seq_tree))[:-1])
        budget = self.max_tokens_per_batch
        units = []
        for lo, hi, seqs in zip(tree_start.tolist(), tree_end.tolist(), by_tree):
            if budget is None or hi - lo <= budget:
                units.append(_Unit(np.arange(lo, hi), seqs))
                continue
            for group in split_tree(forest, seqs, budget):
                lin = _ranges(forest.seq_offsets[group], forest.seq_offsets[group + 1])
                units.append(_Unit(np.unique(forest.lin_unique[lin]), group))
        return units

    def plan(self, forest: Forest) -> list[MicroBatch]:
        """Rows of units packed in order within the budget, one :class:`MicroBatch` each."""
        units = self._units(forest)
        tok_end = token_subtree_end(forest)
        batches = []
        for first, last in pack_in_order(np.array([len(u.tokens) for u in units]), self.max_tokens_per_batch):
            rows, ends, term_lin, term_row, term_target = [], [], [], [], []
            offset = 0
            for unit in units[first:last]:
                sel = unit.tokens
                # a unit is closed under ancestors, so a token's descendants inside it are
                # still contiguous: [its row, rows of unit tokens below its old subtree end)
                ends.append(offset + np.searchsorted(sel, tok_end[sel]))
                lin = _ranges(forest.seq_offsets[unit.sequences] + 1, forest.seq_offsets[unit.sequences + 1])
                u = forest.lin_unique[lin]
                term_lin.append(lin)
                term_row.append(offset + np.searchsorted(sel, forest.predecessor[u]))
                term_target.append(offset + np.searchsorted(sel, u))
                rows.append(sel)
                offset += len(sel)
            row_unique = np.concatenate(rows)
            batches.append(
                MicroBatch(
                    row_unique=row_unique,
                    position_ids=forest.positions[row_unique],
                    term_lin=np.concatenate(term_lin),
                    term_row=np.concatenate(term_row),
                    term_target=np.concatenate(term_target),
                    layout=TreeMaskLayout(np.concatenate(ends)),
                )
            )
        return batches

    def _attend(self, layout: TreeMaskLayout) -> AttendFn:
        backend = self.attention
        # a fresh layout per call: the masks it builds on the device (a dense [T, T] one
        # for sdpa) are shared by every layer and freed with the call, not kept by the plan
        layout = TreeMaskLayout(layout.subtree_end)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return tree_mask_attention(q, k, v, layout, scale, backend)

        return attend

    def _metrics(self, forest: Forest, batches: Sequence[MicroBatch]) -> dict:
        budget = self.max_tokens_per_batch
        tree_sizes = np.diff(np.append(forest.node_start[forest.tree_roots], forest.num_unique_tokens))
        split = 0 if budget is None else int(np.count_nonzero(tree_sizes > budget))
        return {**super()._metrics(forest, batches), "split_trees": split}
