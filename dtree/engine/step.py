"""The training step's two ends, shared by :class:`dtree.TreeRuntime` and the baselines.

A *step* is one ``forward_backward`` call; it reads check -> weights -> plan -> walk ->
finish. Every method trains a :class:`~dtree.losses.TokenLoss` the same way; only the
plan and the model calls in the middle (the walk) differ::

    forest, weights = token_loss_weights(forest, loss, normalization)   validate the fields, [N] weights
    (the method plans its calls and selects its terms: those with a non-zero weight)
    with TokenStep(...) as step:   param.grad moved aside: a failed step loses nothing
        step.per_token             the loss's functions get LossFields (a missing field is named)
                                   and their results are checked (a tensor, not detached)
        walk(step.per_token)       the method's forward/backward over its calls -> WalkOutput
        step.finish(walked)        float(total), the step's one device sync; non-finite ->
                                   param.grad restored, ValueError naming (sequence, position);
                                   StepOutput: counters, the method's metrics, the loss's metrics
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import torch

from ..device.transfer import upload
from ..forest.forest import Forest
from ..losses import Normalization, PerTokenFn, TokenLoss, add_metric_sums, masked_metric_sums, means_of_sums
from ..ops.logprobs import compute_dtype
from ..ops.weight_grads import in_place_weight_grads
from ..plan.loss_terms import prediction_lin
from .checks import check_forest, check_loss_argument, check_normalization, raise_non_finite
from .collector import CollectorPause
from .grad_guard import KEPT_NOTE
from .grad_guard import grad_guard as guard_grads

__all__ = [
    "KeptLogprobs", "LossFields", "MissingFieldError", "StepOutput", "TokenStep", "WalkOutput", "checked_loss",
    "host_values", "loss_metric_sums", "per_sequence", "token_loss_weights",
]


@dataclass
class StepOutput:
    """What ``forward_backward`` returns (:class:`dtree.TreeRuntime` and the baselines).

    ``loss`` is the loss value (the same number linearized training reports). The
    rest are counters of the step: model calls, stack slots used, and the most tree
    tokens whose autograd graph was alive at once (the activation-memory driver).
    """

    loss: float
    num_sequences: int
    num_unique_tokens: int
    num_linearized_tokens: int
    num_loss_terms: int
    num_model_calls: int
    stack_tokens: int
    peak_graph_tokens: int
    seconds: float
    # the method's own counters (dtree: the mode, attention backend, groups, memory plan;
    # baselines: micro-batches, recomputed tokens), then the loss's metrics (TRL's names:
    # clip_ratio/low_mean, kl, entropy, ...) as mask-weighted means over the loss tokens
    metrics: dict = field(default_factory=dict)
    # with forward_backward(..., return_logprobs=True): per sequence, the [len-1] log-probs
    # the loss saw, and the entropies when the loss computed them (needs_entropy), detached.
    # One pass: 0 at predictions without a loss term; two passes: every prediction.
    logprobs: list | None = None
    entropy: list | None = None


@dataclass
class WalkOutput:
    """What a method's forward/backward over its calls leaves besides the gradients.

    Attributes:
        total: 0-d device sum of the weighted loss terms (not synced yet).
        term_log: per call with terms, (offset into the step's ``loss_lin``, [E_call]
            detached weighted terms), in call order.
        num_model_calls, peak_graph_tokens, stack_tokens: the step's counters.
        metrics: the method's own entries of ``StepOutput.metrics``.
    """

    total: torch.Tensor
    term_log: list[tuple[int, torch.Tensor]]
    num_model_calls: int
    peak_graph_tokens: int
    stack_tokens: int = 0
    metrics: dict = field(default_factory=dict)


def token_loss_weights(
    forest: Forest, loss: TokenLoss, normalization: Normalization | None
) -> tuple[Forest, np.ndarray]:
    """Check the arguments (a Forest, a TokenLoss, a Normalization or None) and that
    ``forest`` has the fields ``loss`` needs, then ``loss.prepare``: the forest to train
    on (with the weights of the loss's parts as fields, when it has parts) and its [N]
    per-term weights (reduction, loss mask and ``normalization`` folded in)."""
    check_forest(forest)
    check_loss_argument(loss)
    if not isinstance(loss, TokenLoss):
        raise TypeError(f"expected a dtree.losses.TokenLoss, got {type(loss).__name__}")
    check_normalization(normalization)
    loss.check_fields(forest, supports_temperature=True, supports_entropy=True)
    return loss.prepare(forest, normalization)


class MissingFieldError(KeyError, ValueError):
    """A loss function read a field it did not get. A ValueError (bad input, named),
    and a KeyError so that ``fields.get(name)`` and ``name in fields`` keep working."""

    def __str__(self) -> str:
        return str(self.args[0])


class LossFields(Mapping[str, torch.Tensor]):
    """The fields a loss's functions see (name -> [M]); reading a missing one raises a
    :class:`MissingFieldError` that says how to provide it."""

    def __init__(self, fields: Mapping[str, torch.Tensor], loss: TokenLoss, forest_fields: Iterable[str],
                 note: str = KEPT_NOTE) -> None:
        self._fields, self._loss, self._forest_fields, self._note = fields, loss, sorted(forest_fields), note

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._fields[name]
        except KeyError:
            raise MissingFieldError(self._explain(name)) from None

    def __iter__(self):
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def _explain(self, name: str) -> str:
        loss = f"loss {self._loss.name!r} read fields[{name!r}]"
        if name == "entropy":
            fix = "only a loss with needs_entropy=True gets it: TokenLoss(..., needs_entropy=True)"
        elif name in self._forest_fields:
            fix = (
                f"which is not in its required_fields {tuple(self._loss.required_fields)}: list it, "
                f"TokenLoss(fn, required_fields=(..., {name!r})), so it is checked and uploaded before the step"
            )
        else:
            fix = (
                f"which the forest does not have (its fields: {self._forest_fields}): add it, "
                f"Forest.from_sequences(..., {name}=...) or forest.with_fields({name}=...), and list it in "
                "required_fields"
            )
        return f"{loss}, {fix}; {self._note}"


def _checked_output(loss: TokenLoss, out: object, logp: torch.Tensor, note: str = KEPT_NOTE) -> torch.Tensor:
    """A per-token function's result: a tensor that carries gradient back to ``logp``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"the per-token function of loss {loss.name!r} returned {type(out).__name__}; it must return a torch "
            "tensor [M] computed from logp with torch operations (numpy arrays and Python numbers carry no gradient)"
        )
    if logp.requires_grad and not out.requires_grad:
        raise ValueError(
            f"the per-token function of loss {loss.name!r} returned a tensor that does not depend on logp (detached, "
            "or computed from the fields alone): no gradient would reach the model. Compute it from logp with torch "
            f"operations, without .detach(), .item() or numpy; {note}"
        )
    return out


def checked_loss(loss: TokenLoss, forest: Forest, note: str = KEPT_NOTE) -> TokenLoss:
    """``loss`` whose per-token and metric functions read :class:`LossFields` (a missing
    field is named, with the fix) and whose per-token results are checked
    (:func:`_checked_output`): mistakes inside a user's function become clear errors, ending
    with ``note`` (what became of ``param.grad``: :mod:`dtree.engine.grad_guard`)."""
    names = tuple(forest.fields)
    per_token, metrics = loss.per_token, loss.metrics

    def checked(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return _checked_output(loss, per_token(logp, LossFields(fields, loss, names, note)), logp, note)

    def checked_metrics(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> dict:
        return metrics(logp, LossFields(fields, loss, names, note))

    return dataclasses.replace(loss, per_token=checked, metrics=None if metrics is None else checked_metrics)


class TokenStep:
    """One training step of a :class:`~dtree.losses.TokenLoss` over ``forest``, around the
    method's own forward/backward::

        with TokenStep(parameters, forest, loss, loss_lin, device, dtype) as step:
            walked = <forward/backward of every call>(step.per_token)   -> WalkOutput
            out = step.finish(walked)

    On entering, ``param.grad`` is moved aside (a failed step loses nothing: it is
    restored when the block raises; ``grad_guard="host"``: kept in pinned host memory;
    ``grad_guard=False``: the step accumulates into it in place, :mod:`dtree.engine.grad_guard`), and Python's automatic garbage collection is paused
    until the step ends (``pause_gc``: :mod:`dtree.engine.collector`); the lean layers' projections
    add their weight gradients into ``param.grad`` inside their matmuls (``weight_grads_in_matmul``:
    :mod:`dtree.ops.weight_grads`; every method runs its steps in this class, so all do alike). ``per_token`` is the
    loss's function whose fields are :class:`LossFields` and whose results are checked
    (:func:`checked_loss`); it records the loss's metrics, and keeps the log-probs the loss saw when
    ``return_logprobs``. ``loss_lin``: [E] linearized index of each of the step's terms,
    in ``term_log`` order. :meth:`finish` makes the step's one device sync; a non-finite
    loss raises a ValueError naming the first bad term."""

    def __init__(
        self, parameters: Iterable[torch.nn.Parameter], forest: Forest, loss: TokenLoss, loss_lin: np.ndarray,
        device: torch.device, dtype: torch.dtype, return_logprobs: bool = False, started: float | None = None,
        pause_gc: bool = True, grad_guard: bool | str = True, weight_grads_in_matmul: bool = True,
    ) -> None:
        self.started = time.perf_counter() if started is None else started
        self._stash = guard_grads(parameters, grad_guard)
        self.forest, self.loss, self.loss_lin, self.device, self.dtype = forest, loss, loss_lin, device, dtype
        self.recorded: list[dict] = []  # per call with terms, the loss's per-token metrics
        self.kept = KeptLogprobs() if return_logprobs else None
        per_token = checked_loss(loss, forest, self._stash.note).recording(self.recorded)
        self.per_token: PerTokenFn = per_token if self.kept is None else self.kept.wrap(per_token)
        self._collector = CollectorPause(pause_gc)
        self._weight_grads = in_place_weight_grads(weight_grads_in_matmul)

    def __enter__(self) -> "TokenStep":
        self._stash.__enter__()
        self._collector.__enter__()
        self._weight_grads.__enter__()
        return self

    def __exit__(self, *exc) -> bool | None:
        self._weight_grads.__exit__(*exc)
        self._collector.__exit__(*exc)
        return self._stash.__exit__(*exc)

    def releasing_bytes(self) -> float:
        """Bytes the step frees when it succeeds (the gradients it adds into those kept aside)."""
        return self._stash.releasing_bytes()

    def finish(self, walked: WalkOutput) -> StepOutput:
        """The step's output: the loss value (non-finite: ValueError), the walk's counters and
        metrics, the loss's metrics; the loss and the metrics come to the host in the step's one
        device sync."""
        forest, loss_lin = self.forest, self.loss_lin
        sums = loss_metric_sums(self.loss, forest, loss_lin, walked.term_log, self.recorded, self.device, self.dtype)
        loss_value, loss_means = host_values(walked.total, sums)
        if not np.isfinite(loss_value):  # any non-finite term makes the sum non-finite
            raise_non_finite(forest, loss_lin, walked.term_log, self._stash.note)
        out = StepOutput(
            loss=loss_value, num_sequences=forest.num_sequences, num_unique_tokens=forest.num_unique_tokens,
            num_linearized_tokens=forest.num_linearized_tokens, num_loss_terms=len(loss_lin),
            num_model_calls=walked.num_model_calls, stack_tokens=walked.stack_tokens,
            peak_graph_tokens=walked.peak_graph_tokens, seconds=time.perf_counter() - self.started,
            metrics={**walked.metrics, **loss_means},
        )
        if self.kept is not None:
            out.logprobs, out.entropy = self.kept.per_sequence(
                forest, walked.term_log, loss_lin, self.device, self.dtype, self.loss.needs_entropy
            )
        return out


def loss_metric_sums(
    loss: TokenLoss,
    forest: Forest,
    loss_lin: np.ndarray,
    term_log: list[tuple[int, torch.Tensor]],
    recorded: list[dict],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The loss's metrics as mask-weighted sums over the step's loss terms, on the device
    (:func:`dtree.losses.masked_metric_sums`; no sync). Each call's recorded values pair with
    its entry of ``term_log`` (both in call order)."""
    if not recorded:
        return {}
    mask = upload(loss.metric_mask(forest, loss_lin), device, compute_dtype(dtype))
    sums: dict = {}
    for (e0, weighted), values in zip(term_log, recorded):
        sums = add_metric_sums(sums, masked_metric_sums(values, mask[e0 : e0 + weighted.shape[0]]))
    return sums


def host_values(total: torch.Tensor, sums: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """(the loss's value, :func:`dtree.losses.metric_means` of ``sums``) in one device-to-host
    copy: the step's one sync (two used to leave the GPU idle between them while the host
    built the metrics' mask)."""
    names = list(sums)
    host = torch.stack([total.detach().double().reshape(())] + [sums[k].double() for k in names]).cpu().tolist()
    return host[0], (means_of_sums(dict(zip(names, host[1:]))) if sums else {})


def per_sequence(forest: Forest, values: torch.Tensor, index: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    """``values[index]`` split per sequence: ``index`` [N - S] maps every prediction, in
    linearized order, to its entry of ``values``; one [len-1] tensor per sequence."""
    return list(torch.split(values[upload(index, device)], (forest.sequence_lengths() - 1).tolist()))


class KeptLogprobs:
    """``forward_backward(..., return_logprobs=True)``: the log-probs (and entropies) the
    loss saw, kept from its per-token calls at no extra compute.

    :meth:`wrap` the step's per-token function; then :meth:`per_sequence` with the step's
    ``term_log`` (:class:`WalkOutput`)."""

    def __init__(self) -> None:
        self.kept: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # per call with terms, in call order

    def wrap(self, per_token: PerTokenFn) -> PerTokenFn:
        """``per_token``, also keeping each call's detached (logp, entropy or None)."""

        def kept(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
            ent = fields.get("entropy")
            self.kept.append((logp.detach(), None if ent is None else ent.detach()))
            return per_token(logp, fields)

        return kept

    def per_sequence(
        self, forest: Forest, term_log: list[tuple[int, torch.Tensor]], loss_lin: np.ndarray, device: torch.device,
        dtype: torch.dtype, with_entropy: bool,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Scatter each call's values to its terms' linearized positions (``loss_lin``
        [E]), then split per sequence into [len-1] prediction-aligned tensors (0 where
        no term); the entropies too when ``with_entropy``, else None."""
        lp = torch.zeros(forest.num_linearized_tokens, dtype=compute_dtype(dtype), device=device)
        ent = torch.zeros_like(lp) if with_entropy else None
        lin = upload(loss_lin, device)
        for (e0, weighted), (values, entropies) in zip(term_log, self.kept):  # both in call order
            where = lin[e0 : e0 + weighted.shape[0]]
            lp[where] = values
            if ent is not None:
                ent[where] = entropies
        pred = prediction_lin(forest)
        ents = per_sequence(forest, ent, pred, device) if ent is not None else None
        return per_sequence(forest, lp, pred, device), ents
