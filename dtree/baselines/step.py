"""A training step as packed micro-batches: what both baselines share.

A baseline plans a step as a list of :class:`MicroBatch` (one model call each: a packed
row of tokens, its attention layout, and the loss terms it computes). The step is then
the same for both::

    forest, w = token_loss_weights(forest, loss, normalization)  (dtree.engine.step: the checks, then loss.prepare)
    for each micro-batch:
        hidden = model.dtree_hidden_states(ids, positions, attend)                    [T, H]
        logp, H = token_logprobs(hidden[pred_hidden_row], head, labels, temperature=T)  [P]
        (loss.per_token(logp[loss_pred], fields (+ entropy H)) * w).sum() backward,
            the head's part first (dtree.engine.head_first.HeadSplit, as the runtime's)
    around it, :class:`dtree.engine.step.TokenStep`: one device sync for the loss value;
    if it is not finite, param.grad is restored and a ValueError names the first bad
    (sequence, position); the loss's metrics (mask-weighted means over the loss
    tokens) go into ``StepOutput.metrics``

Gradient accumulation over micro-batches is exact: the weights already hold the
batch-wide normalization (token_mean / sequence_mean over the whole forest).

With ``checkpoint=True`` the model call runs under
:func:`dtree.models.checkpointing.checkpointed_layers` (each decoder layer keeps only
its input and is recomputed in backward), as mask-based trainers run in practice.

The LM head goes through the same chunked :func:`dtree.ops.logprobs.token_logprobs` as
:class:`dtree.TreeRuntime`, so no method ever materializes ``[tokens, vocab]`` logits
and a benchmark measures the effect of the tree alone. Terms with weight 0 (masked
prompt tokens) never reach the LM head, as in the runtime.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..config import check_count, check_flag, check_grad_guard
from ..device.placement import model_placement
from ..device.transfer import upload_arrays
from ..engine.checks import (
    check_loss_argument,
    check_training_call,
    refuse_paths_beyond_window,
    validate_forest,
)
from ..engine.head_first import HeadSplit
from ..engine.step import StepOutput, TokenStep, WalkOutput, token_loss_weights
from ..forest.forest import Forest
from ..losses import Normalization, PerTokenFn, TokenLoss, weighted_terms
from ..models import AttendFn, TreeModule, adapt
from ..models.checkpointing import checkpointed_layers, decoder_layers
from ..ops.backward_once import backward_once_scope
from ..ops.logprobs import as_output_head, compute_dtype
from ..ops.registry import resolve_backend

__all__ = ["MicroBatch", "MicroBatchTrainer", "pack_in_order"]


def pack_in_order(sizes: np.ndarray, budget: int | None) -> list[tuple[int, int]]:
    """Greedy packing of consecutive items into ``[(first, last + 1), ...]`` ranges whose
    sizes sum to at most ``budget``; an item larger than the budget gets a range of its
    own, and ``budget=None`` puts everything in one range."""
    ranges: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(np.asarray(sizes).tolist()):
        if budget is not None and i > start and total + n > budget:
            ranges.append((start, i))
            start, total = i, 0
        total += n
    ranges.append((start, len(sizes)))
    return ranges


def _plain_causal(attend: AttendFn, method: str) -> AttendFn:
    """``attend`` for models that pass attention options: the baselines implement plain
    causal attention only, so softcapping, sinks and ALiBi are refused by name; a
    window is dropped, since ``_check_forest`` refused the paths it would change."""

    def call(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options) -> torch.Tensor:
        used = sorted(name for name, value in options.items() if value is not None and name != "window")
        if used:
            raise ValueError(
                f"the {method} baseline implements plain causal attention, not {used}; train this model with "
                "dtree.TreeRuntime"
            )
        return attend(layer, q, k, v, scale)

    if hasattr(attend, "states"):  # recurrent layers' states (the linearized baseline)
        call.states = attend.states
    return call


@dataclass
class MicroBatch:
    """Host-side plan of one model call.

    Attributes:
        row_unique: [T] int64 unique token of every row of the packed call (its input id
            is ``forest.tokens[row_unique]``).
        position_ids: [T] int64.
        term_lin: [E] linearized index of every prediction ``s[t]`` (t >= 1) this call
            computes the loss of.
        term_row: [E] row whose hidden state predicts it (the row of ``s[t-1]``).
        term_target: [E] row of the token it predicts (the row of ``s[t]``); terms with
            the same target share one LM-head row (the same unique token in a tree).
        layout: the attention layout of the row (op-specific).
    """

    row_unique: np.ndarray
    position_ids: np.ndarray
    term_lin: np.ndarray
    term_row: np.ndarray
    term_target: np.ndarray
    layout: Any

    @property
    def num_tokens(self) -> int:
        return len(self.row_unique)


@dataclass
class _Call:
    """A micro-batch after dropping zero-weight terms and sharing predictions."""

    batch: MicroBatch
    pred_hidden_row: np.ndarray  # [P] rows of the call whose hidden states go through the LM head
    labels: np.ndarray  # [P] token ids they predict
    loss_pred: np.ndarray  # [E'] prediction each kept term reads
    term_lin: np.ndarray  # [E'] linearized index of each kept term


def _select_terms(batch: MicroBatch, weights: np.ndarray, forest: Forest) -> _Call:
    keep = weights[batch.term_lin] != 0
    lin, row, target = batch.term_lin[keep], batch.term_row[keep], batch.term_target[keep]
    _, first, loss_pred = np.unique(target, return_index=True, return_inverse=True)
    return _Call(batch, row[first], forest.lin_tokens[lin[first]], loss_pred.reshape(-1), lin)


class MicroBatchTrainer:
    """Base of the baselines: :meth:`forward_backward` over the micro-batches that
    :meth:`plan` returns, each run with the attention :meth:`_attend` builds.

    Subclasses set ``self.attention`` and implement ``plan`` and ``_attend``. ``grad_guard``:
    as the runtime's (:mod:`dtree.engine.grad_guard`); False is how mask-based and
    linearized trainers accumulate (into ``param.grad`` in place). ``weight_grads_in_matmul``: as the
    runtime's (:mod:`dtree.ops.weight_grads`).
    """

    def __init__(self, model: torch.nn.Module, logprob_chunk: int, checkpoint: bool = False,
                 grad_guard: bool | str = True, rerun_chunk_rows: int | None = None,
                 weight_grads_in_matmul: bool = True) -> None:
        if logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {logprob_chunk}")
        check_count("rerun_chunk_rows", rerun_chunk_rows, minimum=0)
        self.module = model
        self.model: TreeModule = adapt(model)
        self.spec = self.model.dtree_spec()
        self.logprob_chunk = logprob_chunk
        self.checkpoint = bool(checkpoint)
        self.rerun_chunk_rows = rerun_chunk_rows
        check_grad_guard(grad_guard)
        self.grad_guard = grad_guard
        check_flag("weight_grads_in_matmul", weight_grads_in_matmul)
        self.weight_grads_in_matmul = weight_grads_in_matmul
        if self.checkpoint:
            decoder_layers(model)  # raises now, naming the fix, if the layers cannot be found

    @property
    def device(self) -> torch.device:
        """The model's device now (read at every call, like the runtime)."""
        return model_placement(self.module.parameters())[0]

    @property
    def dtype(self) -> torch.dtype:
        return model_placement(self.module.parameters())[1]

    @property
    def recurrence(self) -> str | None:
        """The kernels of the model's recurrent layers (None without), as the runtime's ``auto``."""
        if not self.spec.recurrent_states:
            return None
        return resolve_backend("linear_recurrence", "auto", self.device, self.dtype)

    def plan(self, forest: Forest) -> list[MicroBatch]:
        raise NotImplementedError

    def _attend(self, layout: Any) -> AttendFn:
        raise NotImplementedError

    def _metrics(self, forest: Forest, batches: Sequence[MicroBatch]) -> dict:
        """What ``StepOutput.metrics`` reports: the attention backend, the planned
        micro-batches (one without loss terms is skipped, so ``num_model_calls`` can be
        lower), the tokens they run and how many of those repeat a unique token."""
        computed = int(sum(b.num_tokens for b in batches))
        return {
            "attention": self.attention,
            "micro_batches": len(batches),
            "computed_tokens": computed,
            "tokens_recomputed": computed - forest.num_unique_tokens,
            "checkpoint": self.checkpoint,
        }

    def _check_forest(self, forest: Forest) -> None:
        """The runtime's checks, with its messages: token ids inside the vocabulary,
        sequences within the model's positions; and within its sliding window, which
        the baselines' attention does not implement."""
        validate_forest(forest, self.spec)
        refuse_paths_beyond_window(forest, self.spec, f"{type(self).__name__} baseline")

    def forward_backward(
        self, forest: Forest, loss: TokenLoss, *, normalization: Normalization | None = None
    ) -> StepOutput:
        """Accumulate into ``param.grad`` the gradient of ``loss`` over ``forest``.

        Same contract as :meth:`dtree.TreeRuntime.forward_backward` for a
        :class:`~dtree.losses.TokenLoss` (the runtime's two-pass path for other
        callables has no baseline counterpart); ``normalization`` gives global counts
        when the batch is split over ranks. The step's two ends are :class:`dtree.engine.step.TokenStep`.
        """
        check_loss_argument(loss)
        if not isinstance(loss, TokenLoss):
            raise TypeError(f"the baselines take a dtree.losses.TokenLoss, got {type(loss).__name__}")
        t0 = time.perf_counter()
        check_training_call(self.module.parameters())
        self._check_forest(forest)
        forest, weights = token_loss_weights(forest, loss, normalization)
        batches = self.plan(forest)
        calls = [c for c in (_select_terms(b, weights, forest) for b in batches) if len(c.term_lin)]
        lin = np.concatenate([c.term_lin for c in calls]) if calls else np.zeros(0, dtype=np.int64)

        with TokenStep(self.module.parameters(), forest, loss, lin, self.device, self.dtype, started=t0,
                       grad_guard=self.grad_guard, weight_grads_in_matmul=self.weight_grads_in_matmul) as step:
            total, term_log = self._run(calls, forest, weights, loss, step.per_token)
            walked = WalkOutput(
                total, term_log, num_model_calls=len(calls),
                peak_graph_tokens=max((c.batch.num_tokens for c in calls), default=0),
                metrics=self._metrics(forest, batches),
            )
            return step.finish(walked)

    def _upload(
        self, calls: list[_Call], forest: Forest, weights: np.ndarray, field_names: Sequence[str]
    ) -> list[dict]:
        """Every call's arrays in one host-to-device copy per dtype (as the runtime does);
        returns per call a dict of device views."""
        keys = ("input_ids", "position_ids", "pred_hidden_row", "labels", "loss_pred")
        ints, floats = upload_arrays(
            [a for c in calls for a in (forest.tokens[c.batch.row_unique], c.batch.position_ids, c.pred_hidden_row,
                                        c.labels, c.loss_pred)],
            [a for c in calls for a in [weights[c.term_lin]] + [forest.fields[n][c.term_lin] for n in field_names]],
            self.device, compute_dtype(self.dtype),
        )
        views, per_float = iter(ints), 1 + len(field_names)
        return [
            {**{k: next(views) for k in keys}, "weights": floats[i * per_float],
             "fields": dict(zip(field_names, floats[i * per_float + 1 : (i + 1) * per_float]))}
            for i in range(len(calls))
        ]

    def _run(self, calls: list[_Call], forest: Forest, weights: np.ndarray, loss: TokenLoss, per_token: PerTokenFn):
        """Forward and backward of every call; (loss sum on the device, per call
        (offset into the step's terms, [E_call] detached weighted terms))."""
        total = torch.zeros((), dtype=compute_dtype(self.dtype), device=self.device)
        term_log: list[tuple[int, torch.Tensor]] = []
        if not calls:
            return total, term_log
        output_layer = as_output_head(self.model.dtree_output_layer())
        uploaded = self._upload(calls, forest, weights, loss.field_names)
        e0 = 0
        # the model's attention stays the adapter's through backward: HF gradient
        # checkpointing re-runs layers there
        scope = getattr(self.model, "dtree_scope", None)
        for call, dev in zip(calls, uploaded):
            # each call's graph is back-propagated once, by split.backward (dtree.ops.backward_once)
            with torch.enable_grad(), backward_once_scope(), scope() if scope is not None else contextlib.nullcontext():
                attend = _plain_causal(self._attend(call.batch.layout), type(self).__name__)
                with (checkpointed_layers(self.module, rerun_chunk_rows=self.rerun_chunk_rows) if self.checkpoint
                      else contextlib.nullcontext()):
                    hidden = self.model.dtree_hidden_states(dev["input_ids"], dev["position_ids"], attend)  # [T, H]
                split = HeadSplit(hidden, dev["pred_hidden_row"])
                del hidden  # [T, H]: the head reads the gathered rows; not held through backward
                terms = weighted_terms(
                    per_token, split.head_in, None, dev["labels"], dev["loss_pred"], dev["weights"],
                    dev["fields"], output_layer, self.logprob_chunk,
                    temperature=loss.temperature, with_entropy=loss.needs_entropy, keep_logits=True,
                )
                call_loss = terms.sum()
                split.backward(call_loss)
            term_log.append((e0, terms.detach()))
            e0 += len(call.term_lin)
            total = total + call_loss.detach()
        return total, term_log
