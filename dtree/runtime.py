"""TreeRuntime: forward, backward and log-probs over a forest, depth first, with a KV stack.

The walk (docs/design.md section 4), over the groups of a :class:`~dtree.schedule.Schedule`::

    forward(g):  zero g's gradient slots; run g's segments through the model; every
                 attention layer pushes g's K/V onto the stack and reads the
                 ancestors' K/V from it; compute g's loss terms (retain mode)
    ...          all child groups, depth first
    backward(g): autograd.backward([loss_g, K_g^l, V_g^l for every layer l],
                                   [1,      dK_g^l, dV_g^l from the stack])
                 the attention backward adds g's prefix gradients into the
                 ancestors' slots, so they are complete when the ancestors pop

Modes:
    retain     the graphs of the groups on the current path stay alive between
               forward(g) and backward(g). Activation memory ~ the path, not the tree.
    recompute  forward(g) runs without grad (it only pushes K/V); backward(g) re-runs
               g with grad and backpropagates at once. One group's activations are
               alive at a time, for one extra forward of every group with children.
    auto       per group: retain while the graphs alive at once stay within a token
               budget derived from the free device memory (and an estimate of bytes
               per token), recompute the groups that would exceed it. The outermost
               groups, which live longest, are the ones retained. Retain on CPU.

In every mode a group without children (leaves only) runs once, with grad, and
backpropagates at once: nothing reads its K/V, so it is neither pushed nor recomputed.

Exactness: parameter gradients equal those of linearized training on every sequence
with the same loss, up to floating-point rounding (tests/test_runtime_exact.py checks
every parameter against HF run per path).

Randomness (dropout in LoRA adapters, residual streams, custom modules): every group's
forward runs with its own generator state, seeded from one draw of the global CPU
generator (:mod:`dtree.rng`), and a recomputed group replays it; the LM head's module
path replays its own draws in backward. So retain, recompute and auto give the same
gradients under the same ``torch.manual_seed``. Attention-probability dropout is
refused (the stack attention does not implement it).

Model state is read at every call, not at construction: device and dtype (the KV stack
is reallocated when they change), the LM head (adapters injected later), HF gradient
checkpointing, attention dropout.

Errors: inputs are validated on the host before any kernel runs. A non-finite loss is
detected at the end of the step with a single device sync; ``param.grad`` is then
restored to what it was before the call and a ``ValueError`` names the sequence and
position of the first bad term.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import rng
from .checks import check_trainable, model_placement, raise_non_finite, validate_forest
from .grad_guard import GradStash
from .kv_stack import KVStack
from .losses import Normalization, TokenLoss, weighted_terms
from .models import TreeModule, adapt
from .ops.logprobs import OutputHead, as_output_head, compute_dtype, token_logprobs
from .ops.stack_attention import BACKENDS, SegmentLayout, stack_attention
from .schedule import FORWARD, LossTerms, Schedule, all_predictions, build_schedule, prediction_lin, select_loss_terms
from .transfer import upload
from .tree import Forest

__all__ = ["TreeRuntime", "StepOutput"]

MODES = ("auto", "retain", "recompute")
SequenceLossFn = Callable[[list[torch.Tensor], Forest], torch.Tensor]


@dataclass
class StepOutput:
    """What :meth:`TreeRuntime.forward_backward` returns.

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
    metrics: dict = field(default_factory=dict)  # e.g. the mode "auto" chose


def _check_grad_pattern(state: _GroupState, expected: list) -> None:
    """Every group of a step must have the same layers whose K/V need grad.

    A group's K/V at layer l need grad when a trainable parameter feeds them. For a
    dense model that holds for all groups alike, and the backward may skip K/V without
    a graph. If it held for an ancestor but not for a descendant (trainable parts that
    only some tokens reach, e.g. some MoE experts), the descendant's attention would
    send the ancestor no gradient: refuse rather than be silently wrong. ``expected``
    is empty before the step's first group, then holds its pattern."""
    got = tuple((k.requires_grad, v.requires_grad) for k, v in (kv for kv in state.own if kv is not None))
    if not expected:
        expected.append(got)
    elif got != expected[0]:
        raise ValueError(
            "the layers whose K/V need gradients differ between model calls of one step: trainable parameters "
            "that only some tokens reach (e.g. some MoE experts) cannot be trained through dtree's KV stack; "
            "make the trainable path the same for every token (e.g. train all experts or none)"
        )


class _GroupAttention:
    """The ``attend`` callable handed to the model for one group's call."""

    def __init__(self, stack: KVStack, stack_start: int, layout: SegmentLayout, backend: str, push: bool, record: bool):
        self.stack, self.lo, self.layout, self.backend = stack, stack_start, layout, backend
        self.push, self.record = push, record
        self.own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * stack.num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options
    ) -> torch.Tensor:
        """``options``: the per-layer ``softcap``, ``sinks``, ``alibi_slopes``, ``window``
        of :func:`dtree.ops.stack_attention.stack_attention`."""
        if self.push:
            self.stack.write(layer, self.lo, k.detach(), v.detach())
        if self.record:
            self.own[layer] = (k, v)
        return stack_attention(q, k, v, self.stack, layer, self.layout, scale, self.backend, **options)


@dataclass
class _GroupState:
    loss: torch.Tensor | None
    own: list


def _free_device_memory(device: torch.device) -> float:
    """Bytes the caching allocator can still hand out: free device memory plus what it
    holds unused, capped by ``torch.cuda.set_per_process_memory_fraction``."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get_fraction is not None:
        available = min(available, total * get_fraction(device) - allocated)
    return available


class TreeRuntime:
    """Tree training for a causal LM.

    Args:
        model: a transformers causal LM (Llama, Qwen2, Qwen3, Mistral, ... any model
            using transformers' attention interface), a PEFT ``PeftModel`` wrapping one,
            either of them ``torch.compile``'d, or a module implementing
            :class:`dtree.models.TreeModule`. Gradients land in ``model``'s parameters.
        mode: ``"auto"`` (default), ``"retain"`` or ``"recompute"`` (see module docstring).
        chunk_size: longest segment in tokens; longer trie nodes are split.
        group_tokens: token budget of one packed model call (sibling nodes, nodes of
            different trees and whole small subtrees run together). 0 runs one segment
            per call. None (default): 8192 on CPU; on CUDA what fits in 40% of the free
            memory at the activation bytes per token measured on earlier steps (an
            estimate before the first), between ``chunk_size`` and 32768.
        attention: ``"auto"`` (``triton`` on CUDA when available, else ``sdpa``),
            ``"triton"``, ``"sdpa"`` or ``"reference"``.
        logprob_chunk: rows per chunk of the LM head (memory O(chunk x vocab)).
        stack_capacity: fixed KV-stack size in tokens; None sizes it to each step's plan.
        progress: show a progress bar over the model calls of each step (for long steps).
        compile: ``torch.compile`` the model's decoder layers in place (transformers
            models; see :func:`dtree.models.compile_layers`). Worth it when calls are
            small enough for eager kernel launches to leave the GPU idle.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: str = "auto",
        chunk_size: int = 2048,
        group_tokens: int | None = None,
        attention: str = "auto",
        logprob_chunk: int = 4096,
        stack_capacity: int | None = None,
        progress: bool = False,
        compile: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if attention != "auto" and attention not in BACKENDS:
            raise ValueError(f"attention must be 'auto' or one of {BACKENDS}, got {attention!r}")
        if chunk_size < 1 or (group_tokens is not None and group_tokens < 0) or logprob_chunk < 1:
            raise ValueError("chunk_size and logprob_chunk must be >= 1 and group_tokens >= 0")
        self.module = model  # the user's object: its parameters get the gradients
        self.model: TreeModule = adapt(model)
        self.spec = self.model.dtree_spec()
        self.mode = mode
        self.chunk_size = chunk_size
        self.group_tokens = group_tokens
        self.logprob_chunk = logprob_chunk
        self.stack_capacity = stack_capacity
        self.progress = progress
        if compile:
            from .models import compile_layers

            compile_layers(model)
        self.attention_option = attention
        self._placement: tuple[torch.device, torch.dtype] | None = None
        self._attention: str | None = None
        self._stack: KVStack | None = None
        # activation bytes per token measured on retained groups (CUDA), once there are any
        self._measured_bytes_per_token: float | None = None
        if not any(p.device.type == "meta" for p in model.parameters()):
            self._sync_placement()  # an explicit attention backend that cannot run fails here

    # ------------------------------------------------------------------ setup
    @property
    def device(self) -> torch.device:
        """The model's device now (read from its parameters at every call)."""
        return self._sync_placement()[0]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype now (read from its parameters at every call)."""
        return self._sync_placement()[1]

    @property
    def attention(self) -> str:
        """The attention backend for the model's current device and dtype."""
        self._sync_placement()
        return self._attention

    @property
    def _device(self) -> torch.device:  # inside a call, after _sync_placement
        return self._placement[0]

    @property
    def _dtype(self) -> torch.dtype:
        return self._placement[1]

    def _sync_placement(self) -> tuple[torch.device, torch.dtype]:
        """Read the model's device and dtype; when they changed since the last call
        (``model.to(...)``, a materialized meta model), pick the attention backend
        again and forget what was measured on the old placement. The KV stack is
        reallocated by :meth:`_get_stack`, which checks both."""
        placement = model_placement(self.module.parameters())
        if placement != self._placement:
            self._placement = placement
            self._attention = self._pick_backend(self.attention_option)
            self._measured_bytes_per_token = None
        return placement

    def _check_call(self, training: bool) -> None:
        """Host-side checks of the model's state at every call, before anything is
        allocated: placement, inference mode, what the adapter refuses (gradient
        checkpointing, attention dropout), at least one trainable parameter."""
        if training and torch.is_inference_mode_enabled():
            raise ValueError(
                "forward_backward cannot run under torch.inference_mode() (no gradients there): call it outside the "
                "inference_mode block; TreeRuntime.logprobs works inside one"
            )
        self._sync_placement()
        check = getattr(self.model, "dtree_check", None)
        if check is not None:
            check(training)
        if training:
            check_trainable(self.module.parameters())

    def _randomness(self) -> bool:
        """Whether model calls may draw random numbers (dropout): any module in
        training mode. Then every group runs under its own seed (see module docstring)."""
        return any(m.training for m in self.module.modules())

    def _head(self) -> OutputHead:
        return as_output_head(self.model.dtree_output_layer())

    def _pick_backend(self, attention: str) -> str:
        """``auto``: the fused Triton kernel where it runs (CUDA, Triton installed, 16-bit
        or float32 weights, head_dim <= 256), else SDPA."""
        device, dtype = self._placement
        if attention == "triton" or (
            attention == "auto"
            and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and self.spec.head_dim <= 256
        ):
            try:
                from .ops.stack_attention_triton import require_triton

                require_triton(device)
                return "triton"
            except (ImportError, RuntimeError):
                if attention == "triton":
                    raise
        return "sdpa" if attention == "auto" else attention

    def plan(self, forest: Forest) -> Schedule:
        """Validate ``forest`` against the model and build its schedule."""
        self._sync_placement()
        validate_forest(forest, self.spec)
        sched = build_schedule(forest, self.chunk_size, self._group_budget())
        if self.stack_capacity is not None and sched.stack_tokens > self.stack_capacity:
            lengths = forest.sequence_lengths()
            s = int(np.argmax(lengths))
            hint = (
                f"the longest path (sequence {s}, {int(lengths[s])} tokens) alone exceeds it"
                if lengths[s] > self.stack_capacity
                else "lower group_tokens or raise stack_capacity"
            )
            raise ValueError(
                f"this forest needs {sched.stack_tokens} KV-stack slots but stack_capacity is "
                f"{self.stack_capacity}: {hint}"
            )
        return sched

    def _get_stack(self, capacity: int, with_grad: bool) -> KVStack:
        spec = self.spec
        device, dtype = self._placement
        capacity = max(capacity, self.stack_capacity or 0, 1)
        args = (spec.num_layers, capacity, spec.num_kv_heads, spec.head_dim)
        if self._stack is None or not self._stack.fits(*args, dtype, device, with_grad, spec.v_head_dim):
            self._stack = None  # free the old buffers before allocating new ones
            # Normal tensors even under torch.inference_mode(): an inference-mode stack,
            # kept for reuse, would make every later training step fail.
            with torch.inference_mode(False):
                self._stack = KVStack(*args, v_head_dim=spec.v_head_dim, dtype=dtype, device=device, with_grad=with_grad)
        return self._stack

    def release_memory(self) -> None:
        """Drop the KV stack buffers (they are kept between steps for reuse)."""
        self._stack = None

    # ------------------------------------------------------------------ public API
    def forward_backward(
        self,
        forest: Forest,
        loss: TokenLoss | SequenceLossFn,
        *,
        normalization: Normalization | None = None,
    ) -> StepOutput:
        """Accumulate into ``param.grad`` the gradient of ``loss`` over ``forest``.

        Args:
            loss: a :class:`dtree.losses.TokenLoss` (``nll``, ``ppo_clip``, ...) runs in one
                pass. Any other callable ``fn(logprobs, forest) -> 0-d tensor``, where
                ``logprobs`` is the list :meth:`logprobs` returns, runs in two passes
                (log-probs, then one DFS backward seeded with ``d fn / d logprobs``),
                which is exact for losses that are not sums of per-token terms.
            normalization: global counts for ``token_mean``/``sequence_mean`` when the
                batch is split over ranks (see :mod:`dtree.distributed`).
        """
        self._check_call(training=True)
        if isinstance(loss, TokenLoss):
            loss.check_fields(forest)
            sched = self.plan(forest)
            weights = loss.weights(forest, normalization)
            return self._train(forest, sched, loss.per_token, weights, loss.required_fields)
        if callable(loss):
            return self._two_pass(forest, loss)
        raise TypeError(f"loss must be a dtree.losses.TokenLoss or a callable, got {type(loss).__name__}")

    def backward_from_logprob_grads(
        self, forest: Forest, grads: Sequence[torch.Tensor | None], *, loss_value: float = float("nan")
    ) -> StepOutput:
        """Second pass of the two-pass path: one DFS backward with ``d loss / d logprobs``.

        Args:
            grads: per sequence, [len - 1] gradients of the loss w.r.t. the log-probs
                :meth:`logprobs` returned (None for a sequence the loss ignores).
            loss_value: reported as ``StepOutput.loss``.
        """
        self._check_call(training=True)
        w = self._logprob_grad_weights(forest, grads)
        return self._backward_from_weights(forest, self.plan(forest), w, loss_value)

    @torch.no_grad()
    def logprobs(
        self, forest: Forest, *, with_entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``log p(s[t] | s[:t])`` for t = 1 .. len-1 of every sequence, in input order.

        Returns one 1-D float32 tensor per sequence (empty for one-token sequences);
        with ``with_entropy``, also the entropy of each of those predictive
        distributions. Works under ``torch.inference_mode()``. A model in training mode
        applies its dropout, as its own forward would.
        """
        self._check_call(training=False)
        return self._logprobs(forest, self.plan(forest), with_entropy)

    # ------------------------------------------------------------------ internals
    def _logprobs(self, forest: Forest, sched: Schedule, with_entropy: bool):
        device, dtype = self._placement
        cdt = compute_dtype(dtype)
        terms = all_predictions(sched)
        # per unique token u: log p(u | its prefix), and the entropy of that distribution
        lp_unique = torch.full((forest.num_unique_tokens,), float("nan"), dtype=cdt, device=device)
        ent_unique = torch.full_like(lp_unique, float("nan")) if with_entropy else None
        stack = self._get_stack(sched.stack_tokens, with_grad=False)
        dev = self._to_device(forest, sched, terms, None, ())
        head = self._head()
        randomness = self._randomness()
        for kind, g in self._events(sched):
            if kind != FORWARD:
                continue
            with rng.seeded(rng.next_seed() if randomness else None, device):
                hidden, _ = self._hidden(sched, g, stack, dev, push=True, record=False)
                p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
                if p1 > p0:
                    unique = dev["pred_unique"][p0:p1]
                    lp, ent = token_logprobs(
                        hidden[dev["pred_hidden_row"][p0:p1]], head, dev["labels"][p0:p1], self.logprob_chunk,
                        with_entropy=with_entropy,
                    )
                    lp_unique[unique] = lp
                    if with_entropy:
                        ent_unique[unique] = ent
        targets = upload(forest.lin_unique[prediction_lin(forest)], device)
        sizes = (forest.sequence_lengths() - 1).tolist()
        lps = list(torch.split(lp_unique[targets], sizes))
        if not with_entropy:
            return lps
        return lps, list(torch.split(ent_unique[targets], sizes))

    def _two_pass(self, forest: Forest, loss_fn: SequenceLossFn) -> StepOutput:
        sched = self.plan(forest)  # one schedule for both passes: the same calls, the same draws
        start = rng.capture(self._placement[0])
        with torch.no_grad():
            lps = self._logprobs(forest, sched, with_entropy=False)
        leaves = [lp.detach().requires_grad_(True) for lp in lps]
        with torch.enable_grad():
            value = loss_fn(leaves, forest)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError("a two-pass loss function must return a one-element tensor")
        loss_value = float(value.detach())
        if not np.isfinite(loss_value):
            raise ValueError(f"the loss function returned {loss_value}; param.grad was not touched")
        grads = torch.autograd.grad(value.reshape(()), leaves, allow_unused=True)
        w = self._logprob_grad_weights(forest, list(grads))
        # the second pass replays the first's random draws (dropout masks), so its
        # gradient is that of the log-probs the loss saw
        rng.restore(start, self._placement[0])
        return self._backward_from_weights(forest, sched, w, loss_value)

    def _logprob_grad_weights(self, forest: Forest, grads: Sequence[torch.Tensor | None]) -> np.ndarray:
        """[N] per linearized token: d loss / d logp (0 at sequence starts and where None)."""
        if len(grads) != forest.num_sequences:
            raise ValueError(f"got {len(grads)} gradient tensors for {forest.num_sequences} sequences")
        w = np.zeros(forest.num_linearized_tokens)
        for s, g in enumerate(grads):
            n = int(forest.seq_offsets[s + 1] - forest.seq_offsets[s]) - 1
            if g is None:
                continue
            g = g.detach().double().cpu().numpy().reshape(-1)
            if g.shape[0] != n:
                raise ValueError(f"gradient for sequence {s} has {g.shape[0]} values, expected {n} (len - 1)")
            bad = np.flatnonzero(~np.isfinite(g))
            if bad.size:
                raise ValueError(f"loss gradient is {g[bad[0]]} at sequence {s}, position {int(bad[0]) + 1}")
            w[forest.seq_offsets[s] + 1 : forest.seq_offsets[s + 1]] = g
        return w

    def _backward_from_weights(self, forest: Forest, sched: Schedule, w: np.ndarray, loss_value: float) -> StepOutput:
        out = self._train(forest, sched, lambda logp, fields: logp, w, ())
        out.loss = float(loss_value)
        return out

    def _events(self, sched: Schedule):
        if not self.progress:
            return sched.events
        from tqdm import tqdm

        return tqdm(sched.events, desc="dtree step", unit="event", leave=False)

    def _to_device(
        self, forest: Forest, sched: Schedule, terms: LossTerms, weights: np.ndarray | None, field_names: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Every per-step array the walk slices, moved to the device once."""
        ints = {
            "input_ids": forest.tokens[sched.row_unique],
            "positions": forest.positions[sched.row_unique],
            "row_unique": sched.row_unique,
            "pred_hidden_row": terms.pred_hidden_row,
            "pred_unique": terms.pred_unique,
            "labels": forest.tokens[terms.pred_unique],
            "loss_pred": terms.loss_pred,
        }
        dev = {k: upload(v.astype(np.int64, copy=False), self._device) for k, v in ints.items()}
        cdt = compute_dtype(self._dtype)
        if weights is not None:
            dev["weights"] = upload(weights[terms.loss_lin], self._device, cdt)
            dev["fields"] = {
                n: upload(forest.fields[n][terms.loss_lin], self._device, cdt) for n in field_names
            }
        return dev

    def _layout(self, sched: Schedule, g: int) -> SegmentLayout:
        plan = sched.groups[g]
        return SegmentLayout(
            q_offsets=plan.seg_q_offsets,
            own_slot=plan.stack_start + plan.seg_q_offsets[:-1],
            prefix_ranges=plan.seg_prefix_ranges,
            call_slots=(plan.stack_start, plan.stack_start + plan.num_tokens) if plan.in_call_ancestors else None,
        )

    def _hidden(
        self, sched: Schedule, g: int, stack: KVStack, dev: dict, push: bool, record: bool
    ) -> tuple[torch.Tensor, _GroupAttention]:
        """Run group ``g`` through the model: ([T, hidden] final hidden states, its attend)."""
        r0, r1 = int(sched.row_offsets[g]), int(sched.row_offsets[g + 1])
        attend = _GroupAttention(stack, sched.groups[g].stack_start, self._layout(sched, g), self._attention, push, record)
        hidden = self.model.dtree_hidden_states(dev["input_ids"][r0:r1], dev["positions"][r0:r1], attend)
        return hidden, attend

    def _group_loss(
        self, g: int, hidden: torch.Tensor, terms: LossTerms, dev: dict, per_token: Callable, term_log: list,
        head: OutputHead,
    ) -> torch.Tensor | None:
        e0, e1 = int(terms.loss_offsets[g]), int(terms.loss_offsets[g + 1])
        if e1 == e0:
            return None
        p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
        weighted = weighted_terms(
            per_token,
            hidden,
            dev["pred_hidden_row"][p0:p1],
            dev["labels"][p0:p1],
            dev["loss_pred"][e0:e1],
            dev["weights"][e0:e1],
            {n: f[e0:e1] for n, f in dev["fields"].items()},
            head,
            self.logprob_chunk,
        )
        term_log.append((e0, weighted.detach()))
        return weighted.sum()

    def _run_group(self, sched, g, stack, terms, dev, per_token, term_log, head, push: bool) -> _GroupState:
        hidden, attend = self._hidden(sched, g, stack, dev, push=push, record=True)
        loss = self._group_loss(g, hidden, terms, dev, per_token, term_log, head)
        return _GroupState(loss=loss, own=attend.own)

    def _backward_group(
        self, state: _GroupState, stack: KVStack, lo: int, hi: int, seed_kv: bool, clear: bool = False
    ) -> None:
        """Backpropagate the group's loss and its K/V seeded with the stack's gradients.

        Only tensors that require grad take part: K/V of frozen layers (layer 0 of a
        model with frozen embeddings and k_proj, as under LoRA on q/v) have no graph.
        Their stack slots still receive the descendants' prefix gradients, which are
        dropped with nothing lost: a K/V without a graph depends on no trainable
        parameter, in this group or any other (:func:`_check_grad_pattern`)."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if state.loss is not None and state.loss.requires_grad:
            tensors.append(state.loss)
            grads.append(torch.ones_like(state.loss))
        if seed_kv:
            missing = [layer for layer, kv in enumerate(state.own) if kv is None]
            if missing:
                raise RuntimeError(f"layers {missing} never called attend(); every attention layer must")
            seeded = [(layer, k, v) for layer, (k, v) in enumerate(state.own) if k.requires_grad or v.requires_grad]
            if seeded:
                dtype = state.own[0][0].dtype
                # one conversion kernel for all layers, not two per layer (a copy even in float32,
                # since clearing the slots below must not clear the seeds)
                gk_all, gv_all = (g[:, lo:hi].to(dtype, copy=True) for g in (stack.grad_k, stack.grad_v))
            if clear:
                stack.zero_grad(lo, hi)
            for layer, k, v in seeded:
                if k.requires_grad:
                    tensors.append(k)
                    grads.append(gk_all[layer])
                if v.requires_grad:
                    tensors.append(v)
                    grads.append(gv_all[layer])
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _train(
        self,
        forest: Forest,
        sched: Schedule,
        per_token: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor],
        weights: np.ndarray,
        field_names: Sequence[str],
    ) -> StepOutput:
        t0 = time.perf_counter()
        terms = select_loss_terms(sched, weights)
        with GradStash(self.module.parameters()):  # a failed step leaves param.grad as it was
            total, term_log, calls, peak, recomputed = self._walk(sched, terms, forest, weights, field_names, per_token)
            loss_value = float(total)  # the step's one device sync
            if not np.isfinite(loss_value):  # any non-finite term makes the sum non-finite
                raise_non_finite(forest, terms.loss_lin, term_log)
        return StepOutput(
            loss=loss_value,
            num_sequences=forest.num_sequences,
            num_unique_tokens=forest.num_unique_tokens,
            num_linearized_tokens=forest.num_linearized_tokens,
            num_loss_terms=len(terms.loss_lin),
            num_model_calls=calls,
            stack_tokens=sched.stack_tokens,
            peak_graph_tokens=peak,
            seconds=time.perf_counter() - t0,
            metrics={
                "mode": self.mode,
                "attention": self._attention,
                "groups": sched.num_groups,
                "group_tokens": sched.group_tokens,
                "recomputed_tokens": recomputed,
                "bytes_per_token": self._bytes_per_token(),
            },
        )

    def _group_budget(self) -> int:
        """Tokens per model call: ``group_tokens``, or the automatic choice (see the
        class docstring): large calls keep the GPU busy, and one call's activations
        must fit with room left for the graphs retain mode keeps."""
        if self.group_tokens is not None:
            return self.group_tokens
        if self._device.type != "cuda":
            return 8192
        fit = _free_device_memory(self._device) / 2.5 / self._bytes_per_token()
        return int(min(32768, max(self.chunk_size, fit // 1024 * 1024)))

    def _bytes_per_token(self) -> float:
        """Activation bytes one token's graph keeps: measured on this runtime's retained
        groups once it has run some (compiled layers keep ~30% less than eager, a 7B
        model ~2x less than the estimate), else the conservative estimate of
        :meth:`ModelSpec.activation_bytes_per_token`."""
        if self._measured_bytes_per_token is not None:
            return self._measured_bytes_per_token
        return self.spec.activation_bytes_per_token(torch.empty((), dtype=self._dtype).element_size())

    def _retain_budget(self, sched: Schedule) -> float:
        """Tokens whose graphs may be alive at once: unbounded in retain mode (and on
        CPU), 0 in recompute mode; in auto mode what fits in 80% of the free device
        memory after the stack and one LM-head chunk."""
        if self.mode == "retain" or (self.mode == "auto" and self._device.type != "cuda"):
            return float("inf")
        if self.mode == "recompute":
            return 0.0
        free = _free_device_memory(self._device)
        itemsize = torch.empty((), dtype=self._dtype).element_size()
        spec = self.spec
        stack = 0 if self._stack is not None and self._stack.capacity >= sched.stack_tokens else (
            sched.stack_tokens * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * (itemsize + 4)
        )
        logits = self.logprob_chunk * spec.vocab_size * (itemsize + 8)
        return max(0.0, 0.8 * free - stack - logits) / self._bytes_per_token()

    def _walk(self, sched, terms, forest, weights, field_names, per_token):
        budget = self._retain_budget(sched)
        stack = self._get_stack(sched.stack_tokens, with_grad=True)
        dev = self._to_device(forest, sched, terms, weights, field_names)
        head = self._head()
        device = self._device
        randomness = self._randomness()
        seeds: dict[int, int | None] = {}  # the seed of each group to recompute
        pattern: list = []  # which layers' K/V need grad, as seen in the step's first group
        live: dict[int, _GroupState] = {}
        term_log: list[torch.Tensor] = []
        total = torch.zeros((), dtype=compute_dtype(self._dtype), device=device)
        calls = live_tokens = peak = recomputed = 0

        def run(g: int, push: bool, seed: int | None) -> _GroupState:
            with torch.enable_grad(), rng.seeded(seed, device):
                state = self._run_group(sched, g, stack, terms, dev, per_token, term_log, head, push=push)
            _check_grad_pattern(state, pattern)
            return state

        for kind, g in self._events(sched):
            plan = sched.groups[g]
            lo, hi = plan.stack_start, plan.stack_start + plan.num_tokens
            if kind == FORWARD:
                calls += 1
                seed = rng.next_seed() if randomness else None  # one draw per group in every mode
                if plan.is_leaf:  # once, with grad, and backward at once (see module docstring)
                    if plan.in_call_ancestors:  # its segments read each other through the stack
                        stack.zero_grad(lo, hi)
                    state = run(g, push=plan.in_call_ancestors, seed=seed)
                    peak = max(peak, live_tokens + plan.num_tokens)
                    total = self._finish_group(state, stack, lo, hi, total, seed_kv=False)
                    continue
                stack.zero_grad(lo, hi)
                if live_tokens + plan.num_tokens <= budget:
                    before = self._allocated()
                    live[g] = run(g, push=True, seed=seed)
                    self._observe_retained(self._allocated() - before, plan.num_tokens)
                    live_tokens += plan.num_tokens
                    peak = max(peak, live_tokens)
                else:
                    seeds[g] = seed
                    with torch.no_grad(), rng.seeded(seed, device):
                        self._hidden(sched, g, stack, dev, push=True, record=False)
                continue
            if plan.is_leaf:
                continue
            if g in live:
                state = live.pop(g)
                live_tokens -= plan.num_tokens
            else:
                calls += 1
                recomputed += plan.num_tokens
                # K/V are on the stack already; pushing again would only rewrite them. The
                # seed replays the forward's dropout masks, so the graph is of those K/V.
                state = run(g, push=False, seed=seeds.pop(g))
                peak = max(peak, live_tokens + plan.num_tokens)
            total = self._finish_group(state, stack, lo, hi, total, seed_kv=True, clear=plan.in_call_ancestors)
        return total, term_log, calls, peak, recomputed

    def _allocated(self) -> int:
        """Bytes allocated on the device (host-side bookkeeping: no sync); 0 on CPU."""
        return torch.cuda.memory_allocated(self._device) if self._device.type == "cuda" else 0

    def _observe_retained(self, nbytes: int, tokens: int) -> None:
        """Record the memory a retained group's graph holds, per token (the largest
        seen, so later budgets stay on the safe side of what was measured). Groups
        of a few tokens are skipped: fixed costs would dominate them."""
        if self._device.type != "cuda" or tokens < 256 or nbytes <= 0:
            return
        per_token = nbytes / tokens
        seen = self._measured_bytes_per_token
        self._measured_bytes_per_token = per_token if seen is None else max(seen, per_token)

    def _finish_group(
        self, state: _GroupState, stack: KVStack, lo: int, hi: int, total, seed_kv: bool, clear: bool = False
    ):
        """Backward of one group; returns the running loss sum. ``clear``: empty the
        group's gradient slots once the seeds are read, for the in-call attention
        gradients the backward adds there (``dtree.ops.stack_attention._InCallGrad``)."""
        if state.loss is not None:
            total = total + state.loss.detach()
        self._backward_group(state, stack, lo, hi, seed_kv=seed_kv, clear=clear)
        return total
