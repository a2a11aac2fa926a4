"""TreeRuntime: forward, backward and log-probs over a forest, depth first, with a KV stack.

The walk (docs/design.md section 4), over the groups of a :class:`~dtree.schedule.Schedule`::

    forward(g):  zero g's gradient slots; run g's segments through the model; every
                 attention layer pushes g's K/V onto the stack, reads the ancestors'
                 K/V from it, and takes g's own K/V through ``seed_from_stack``;
                 compute g's loss terms (retain mode)
    ...          all child groups, depth first; their attention backward adds their
                 prefix gradients into g's slots
    backward(g): autograd.backward(loss_g)  (or g's final hidden states with a zero
                 gradient when g has no loss terms): at every layer the seed's
                 backward adds g's slots (the descendants' gradients, and the ones g's
                 own segments sent their in-call ancestors) to dK_g, dV_g where the
                 attention consumed them, and g's attention backward adds its prefix
                 gradients into the ancestors' slots, complete when they pop

Seeds enter where K/V are consumed, inside whatever graph computed them, so any
checkpointing inside the model works: dtree's own per-layer checkpointing
(``checkpoint_layers``) and HF's gradient checkpointing re-run a layer in backward,
re-push its K/V (the same values, into the slots it holds) and seed the re-run K/V.
A frozen layer's K/V (no graph) simply drop their seed: nothing trainable computes them.

Modes:
    retain     the graphs of the groups on the current path stay alive between
               forward(g) and backward(g). Activation memory ~ the path, not the tree.
    recompute  forward(g) runs without grad (it only pushes K/V); backward(g) re-runs
               g with grad and backpropagates at once. One group's activations are
               alive at a time, for one extra forward of every group with children.
    auto       the memory policy (:mod:`dtree.memory_policy`) decides per step: the
               call size, layer checkpointing, the LM-head chunk, and which groups
               with children are retained (the outermost, which live longest) and
               which recomputed. Retain on CPU.

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

Memory (``memory="auto" | "low" | GiB``, :mod:`dtree.memory_policy`): the call size,
layer checkpointing (``checkpoint_layers``: every decoder layer of a call under
non-reentrant ``torch.utils.checkpoint``, keeping its inputs only), the LM-head chunk
and what auto mode retains are planned per step from the model's shape, its dtype,
the memory the process may still allocate and the forest's size; explicit arguments
win.

Model state is read at every call, not at construction: device and dtype (the KV stack
is reallocated when they change), the LM head (adapters injected later), HF gradient
checkpointing (the step runs inside the adapter's attention scope, so HF's re-run
layers in backward attend through the stack), attention dropout.

Errors: inputs are validated on the host before any kernel runs. A non-finite loss is
detected at the end of the step with a single device sync; ``param.grad`` is then
restored to what it was before the call and a ``ValueError`` names the sequence and
position of the first bad term.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import memory_policy, rng
from .checkpointing import checkpointed_layers, decoder_layers
from .checks import check_trainable, model_placement, raise_non_finite, validate_forest
from .grad_guard import GradStash
from .kv_stack import KVStack
from .losses import (
    Normalization,
    SequenceLoss,
    TokenLoss,
    add_metric_sums,
    masked_metric_sums,
    metric_means,
    weighted_terms,
)
from .models import TreeModule, adapt, unwrap
from .ops.logprobs import OutputHead, as_output_head, compute_dtype, fused_head_kernel, token_logprobs
from .ops.stack_attention import BACKENDS, SegmentLayout, seed_from_stack, stack_attention
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
    metrics: dict = field(default_factory=dict)  # e.g. the mode "auto" chose, the loss's metrics
    # with forward_backward(..., return_logprobs=True): per sequence, the [len-1] log-probs
    # the loss saw, and the entropies when the loss computed them (needs_entropy), detached.
    # One pass: 0 at predictions without a loss term; two passes: every prediction.
    logprobs: list | None = None
    entropy: list | None = None


@dataclass(frozen=True)
class _PerToken:
    """What a step evaluates per loss term: ``fn(logp, fields)`` on the log-probs of
    ``softmax(logits / temperature)``, with ``fields["entropy"]`` when ``with_entropy``."""

    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
    temperature: float = 1.0
    with_entropy: bool = False


def _check_temperature(temperature: float) -> float:
    if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive number (the sampling temperature), got {temperature!r}")
    return float(temperature)


def _identity(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return logp


def _keeping(per_token: Callable, sink: list) -> Callable:
    """``per_token``, also appending each call's detached (logp, entropy or None) to ``sink``."""

    def kept(logp: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        ent = fields.get("entropy")
        sink.append((logp.detach(), None if ent is None else ent.detach()))
        return per_token(logp, fields)

    return kept


def _check_grad_pattern(pattern: tuple, expected: list) -> None:
    """Every group of a step must have the same layers whose K/V need grad.

    A group's K/V at layer l need grad when a trainable parameter feeds them. For a
    dense model that holds for all groups alike. If it held for an ancestor but not
    for a descendant (trainable parts that only some tokens reach, e.g. some MoE
    experts), the descendant's attention would have no backward and send the ancestor
    no gradient: refuse rather than be silently wrong. ``pattern``: per layer,
    (k.requires_grad, v.requires_grad) as the group's call saw them with grad on (None
    where it did not); ``expected`` is empty before the step's first group, then holds
    its pattern."""
    if not expected:
        expected.append(pattern)
    elif pattern != expected[0]:
        raise ValueError(
            "the layers whose K/V need gradients differ between model calls of one step: trainable parameters "
            "that only some tokens reach (e.g. some MoE experts) cannot be trained through dtree's KV stack; "
            "make the trainable path the same for every token (e.g. train all experts or none)"
        )


class _GroupAttention:
    """The ``attend`` callable handed to the model for one group's call.

    ``push``: write the call's K/V into its stack slots ``[lo, hi)`` (every time a
    layer runs, also when a checkpointed layer re-runs in backward: the same values).
    ``seed``: pass the call's K/V through :func:`seed_from_stack` (groups whose slots
    collect gradients: groups with children, and calls with in-call ancestors)."""

    def __init__(
        self, stack: KVStack, lo: int, hi: int, layout: SegmentLayout, backend: str, push: bool, seed: bool
    ):
        self.stack, self.lo, self.hi, self.layout, self.backend = stack, lo, hi, layout, backend
        self.push, self.seed = push, seed
        self.called = [False] * stack.num_layers
        self.pattern: list[tuple[bool, bool] | None] = [None] * stack.num_layers

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **options
    ) -> torch.Tensor:
        """``options``: the per-layer ``softcap``, ``sinks``, ``alibi_slopes``, ``window``
        of :func:`dtree.ops.stack_attention.stack_attention`."""
        self.called[layer] = True
        if self.push:
            self.stack.write(layer, self.lo, k.detach(), v.detach())
        if torch.is_grad_enabled():
            self.pattern[layer] = (k.requires_grad, v.requires_grad)
            if self.seed:
                k, v = seed_from_stack(k, v, self.stack, layer, self.lo, self.hi)
        return stack_attention(q, k, v, self.stack, layer, self.layout, scale, self.backend, **options)


@dataclass
class _GroupState:
    """A group's graph between its forward and its backward: the backward's root is
    ``loss``, or ``hidden`` (with a zero gradient) when the group has no loss terms but
    its K/V carry seeds."""

    loss: torch.Tensor | None
    hidden: torch.Tensor | None
    pattern: tuple


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
            per call. None (default): 8192 on CPU; on CUDA the memory policy's choice
            (2048 to 32768).
        attention: ``"auto"`` (``triton`` on CUDA when available, else ``sdpa``),
            ``"triton"``, ``"sdpa"`` or ``"reference"``.
        logprob_chunk: rows per chunk of the LM head (memory O(chunk x vocab)); None
            (default): the memory policy's choice (4096 on CPU).
        checkpoint_layers: run every decoder layer of a call under non-reentrant
            ``torch.utils.checkpoint`` (:mod:`dtree.checkpointing`: autograd keeps each
            layer's input, backward re-runs it). None (default): the memory policy
            decides (off on CPU). Needs the decoder layers as a ``ModuleList``.
        memory: ``"auto"`` (default: the fastest plan that fits the free memory with a
            margin), ``"low"`` (layer checkpointing, 8192-token calls, 1024-row LM-head
            chunks: the least memory), or a number, a cap in GiB on the step's peak
            allocated memory (see :mod:`dtree.memory_policy`).
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
        logprob_chunk: int | None = None,
        stack_capacity: int | None = None,
        progress: bool = False,
        compile: bool = False,
        checkpoint_layers: bool | None = None,
        memory: str | float = "auto",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if attention != "auto" and attention not in BACKENDS:
            raise ValueError(f"attention must be 'auto' or one of {BACKENDS}, got {attention!r}")
        if chunk_size < 1 or (group_tokens is not None and group_tokens < 0) or (
            logprob_chunk is not None and logprob_chunk < 1
        ):
            raise ValueError("chunk_size and logprob_chunk must be >= 1 and group_tokens >= 0")
        if not (memory in memory_policy.SETTINGS or (
            isinstance(memory, (int, float)) and not isinstance(memory, bool) and memory > 0
        )):
            raise ValueError(
                f"memory must be one of {memory_policy.SETTINGS} or a positive number (a cap in GiB), got {memory!r}"
            )
        if checkpoint_layers not in (None, True, False):
            raise ValueError(f"checkpoint_layers must be None (decided per step), True or False, got {checkpoint_layers!r}")
        self.module = model  # the user's object: its parameters get the gradients
        self.model: TreeModule = adapt(model)
        self.spec = self.model.dtree_spec()
        self.mode = mode
        self.chunk_size = chunk_size
        self.group_tokens = group_tokens
        self._logprob_chunk = logprob_chunk
        self.checkpoint_layers = checkpoint_layers
        self.memory = memory
        if checkpoint_layers:
            decoder_layers(unwrap(model))  # raises now, naming the fix, if the layers cannot be found
        self.stack_capacity = stack_capacity
        self.progress = progress
        if compile:
            from .models import compile_layers

            compile_layers(model)
        self.attention_option = attention
        self._placement: tuple[torch.device, torch.dtype] | None = None
        self._attention: str | None = None
        self._stack: KVStack | None = None
        self._step: memory_policy.MemoryPlan | None = None  # the last planned step
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
    def logprob_chunk(self) -> int:
        """Rows per LM-head chunk: the constructor's value, else the last planned step's."""
        if self._logprob_chunk is not None:
            return self._logprob_chunk
        return self._step.logprob_chunk if self._step is not None else memory_policy.DEFAULT_LOGPROB_CHUNK

    @logprob_chunk.setter
    def logprob_chunk(self, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError("logprob_chunk must be >= 1")
        self._logprob_chunk = value

    @property
    def memory_plan(self) -> memory_policy.MemoryPlan | None:
        """The memory policy's decisions for the last planned step (None before one)."""
        return self._step

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
        self._step = self._plan_memory(forest)
        sched = build_schedule(forest, self.chunk_size, self._step.group_tokens)
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

    def _hf_checkpointing(self) -> bool:
        """Whether HF gradient checkpointing is on for some module in training mode
        (it then checkpoints the layers itself and dtree adds no checkpoint)."""
        return any(getattr(m, "gradient_checkpointing", False) is True and m.training for m in self.module.modules())

    def _can_checkpoint_layers(self) -> bool:
        try:
            decoder_layers(unwrap(self.module))
        except ValueError:
            return False
        return True

    def _plan_memory(self, forest: Forest) -> memory_policy.MemoryPlan:
        """The memory policy's plan for a step over ``forest`` (see :mod:`dtree.memory_policy`)."""
        device, dtype = self._placement
        itemsize = torch.empty((), dtype=dtype).element_size()
        lengths = forest.sequence_lengths()
        shape = memory_policy.StepShape(forest.num_unique_tokens, int(lengths.max()) if len(lengths) else 0)
        checkpoint = self.checkpoint_layers
        if checkpoint is None and not self._can_checkpoint_layers():
            checkpoint = False
        kw = {}
        if device.type == "cuda":
            available, allocated = memory_policy.available_bytes(device)
            stack = self._stack
            kw = dict(
                available=available,
                allocated=allocated,
                expandable_segments=memory_policy.expandable_segments(),
                stack_held=float(stack.nbytes()) if stack is not None and stack.device == device else 0.0,
                missing_grads=memory_policy.missing_grad_bytes(self.module.parameters()),
                fused_head=fused_head_kernel(self._head(), dtype, device),
            )
        return memory_policy.plan_step(
            self.spec, itemsize, shape, on_cuda=device.type == "cuda", setting=self.memory,
            group_tokens=self.group_tokens, checkpoint_layers=checkpoint, logprob_chunk=self._logprob_chunk,
            hf_checkpointing=self._hf_checkpointing(), **kw,
        )

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
        loss: TokenLoss | SequenceLoss | SequenceLossFn,
        *,
        normalization: Normalization | None = None,
        return_logprobs: bool = False,
    ) -> StepOutput:
        """Accumulate into ``param.grad`` the gradient of ``loss`` over ``forest``.

        Args:
            loss: a :class:`dtree.losses.TokenLoss` (``nll``, ``ppo_clip``, ...) runs in one
                pass, at the loss's ``temperature``, with the entropy when it
                ``needs_entropy``. A :class:`dtree.losses.SequenceLoss` (``gspo``) or any
                other callable ``fn(logprobs, forest) -> 0-d tensor``, where ``logprobs`` is
                the list :meth:`logprobs` returns, runs in two passes (log-probs, then one
                DFS backward seeded with ``d fn / d logprobs``), which is exact for losses
                that are not sums of per-token terms; a ``SequenceLoss``'s log-probs are at
                its ``temperature``, a plain callable's at 1.
            normalization: the counts the reduction divides by (default: the forest's
                own): ``Normalization.from_forests`` over the micro-batches of one optimizer
                step, or the global counts over ranks. For a ``SequenceLoss`` it replaces
                the loss's own ``normalization``; a plain callable normalizes itself and
                refuses it.
            return_logprobs: also return, per sequence, the log-probs (and entropies) the
                loss saw, in ``StepOutput.logprobs`` / ``StepOutput.entropy`` (for metrics
                a trainer computes itself); no extra compute.

        The loss's metrics (mask-weighted means over the loss tokens, named as TRL logs
        them: ``clip_ratio/low_mean``, ``kl``, ``entropy``, ...) are in ``StepOutput.metrics``.
        """
        self._check_call(training=True)
        if isinstance(loss, TokenLoss):
            loss.check_fields(forest, supports_temperature=True, supports_entropy=True)
            sched = self.plan(forest)
            weights = loss.weights(forest, normalization)
            return self._train(forest, sched, loss, weights, return_logprobs=return_logprobs)
        if isinstance(loss, SequenceLoss):
            loss.check_fields(forest)
            if normalization is not None:
                if loss.normalization is not None and loss.normalization != normalization:
                    raise ValueError(
                        f"loss {loss.name!r} carries normalization={loss.normalization} and forward_backward got "
                        f"normalization={normalization}: pass one of them"
                    )
                loss = loss.with_normalization(normalization)
            return self._two_pass(forest, loss, loss.temperature, return_logprobs)
        if callable(loss):
            if normalization is not None:
                raise ValueError(
                    "normalization= applies to a TokenLoss or a dtree.losses.SequenceLoss; a plain two-pass callable "
                    "fn(logprobs, forest) divides by whatever it chooses: normalize inside it, or wrap its per-token "
                    "terms in a SequenceLoss"
                )
            return self._two_pass(forest, loss, 1.0, return_logprobs)
        raise TypeError(f"loss must be a dtree.losses.TokenLoss, a SequenceLoss or a callable, got {type(loss).__name__}")

    def backward_from_logprob_grads(
        self,
        forest: Forest,
        grads: Sequence[torch.Tensor | None],
        *,
        loss_value: float = float("nan"),
        temperature: float = 1.0,
    ) -> StepOutput:
        """Second pass of the two-pass path: one DFS backward with ``d loss / d logprobs``.

        Args:
            grads: per sequence, [len - 1] gradients of the loss w.r.t. the log-probs
                :meth:`logprobs` returned (None for a sequence the loss ignores).
            loss_value: reported as ``StepOutput.loss``.
            temperature: the temperature those log-probs were computed at (the
                gradient flows through ``softmax(logits / temperature)``).
        """
        self._check_call(training=True)
        temperature = _check_temperature(temperature)
        w = self._logprob_grad_weights(forest, grads)
        return self._backward_from_weights(forest, self.plan(forest), w, loss_value, temperature)

    @torch.no_grad()
    def logprobs(self, forest: Forest, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """``log p(s[t] | s[:t])`` for t = 1 .. len-1 of every sequence, in input order,
        under ``softmax(logits / temperature)`` (the sampling temperature).

        Returns one 1-D float32 tensor of ``len - 1`` values per sequence (empty for
        one-token sequences); ``forest.with_fields(old_logprobs=rt.logprobs(forest))``
        puts them back as a field. Works under ``torch.inference_mode()``. A model in
        training mode applies its dropout, as its own forward would.
        """
        return self._inference(forest, temperature, with_entropy=False)[0]

    @torch.no_grad()
    def entropy(self, forest: Forest, *, temperature: float = 1.0) -> list[torch.Tensor]:
        """The entropy of each predictive distribution ``softmax(logits / temperature)``
        that :meth:`logprobs` reads, aligned with it: value ``t-1`` is the entropy of the
        distribution that predicts ``s[t]``. One ``[len-1]`` tensor per sequence."""
        return self._inference(forest, temperature, with_entropy=True)[1]

    @torch.no_grad()
    def logprobs_and_entropy(
        self, forest: Forest, *, temperature: float = 1.0
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(:meth:`logprobs`, :meth:`entropy`) in one pass over the forest."""
        return self._inference(forest, temperature, with_entropy=True)

    def _inference(self, forest: Forest, temperature: float, with_entropy: bool):
        """The checks of an inference call, then :meth:`_logprobs`."""
        self._check_call(training=False)
        temperature = _check_temperature(temperature)
        return self._logprobs(forest, self.plan(forest), with_entropy, temperature)

    # ------------------------------------------------------------------ internals
    def _logprobs(
        self, forest: Forest, sched: Schedule, with_entropy: bool, temperature: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(per sequence [len-1] log-probs, and entropies when ``with_entropy`` else None)."""
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
                hidden, _ = self._hidden(sched, g, stack, dev, push=True)
                p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
                if p1 > p0:
                    unique = dev["pred_unique"][p0:p1]
                    lp, ent = token_logprobs(
                        hidden[dev["pred_hidden_row"][p0:p1]], head, dev["labels"][p0:p1], self.logprob_chunk,
                        temperature=temperature, with_entropy=with_entropy,
                    )
                    lp_unique[unique] = lp
                    if with_entropy:
                        ent_unique[unique] = ent
        targets = upload(forest.lin_unique[prediction_lin(forest)], device)
        sizes = (forest.sequence_lengths() - 1).tolist()
        lps = list(torch.split(lp_unique[targets], sizes))
        return lps, (list(torch.split(ent_unique[targets], sizes)) if with_entropy else None)

    def _two_pass(
        self, forest: Forest, loss_fn: SequenceLossFn, temperature: float, return_logprobs: bool
    ) -> StepOutput:
        sched = self.plan(forest)  # one schedule for both passes: the same calls, the same draws
        start = rng.capture(self._placement[0])
        sequence_loss = isinstance(loss_fn, SequenceLoss)
        with_entropy = sequence_loss and loss_fn.needs_entropy
        with torch.no_grad():
            lps, ents = self._logprobs(forest, sched, with_entropy, temperature)
        leaves = [lp.detach().requires_grad_(True) for lp in lps]
        with torch.enable_grad():
            if sequence_loss:
                value = loss_fn(leaves, forest, temperature=temperature, entropy=ents)
            else:
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
        out = self._backward_from_weights(forest, sched, w, loss_value, temperature)
        if sequence_loss:
            out.metrics.update(loss_fn.metric_values(lps, forest, entropy=ents))
        if return_logprobs:
            out.logprobs, out.entropy = lps, ents
        return out

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

    def _backward_from_weights(
        self, forest: Forest, sched: Schedule, w: np.ndarray, loss_value: float, temperature: float
    ) -> StepOutput:
        # sum_k w[k] * logp[k] at the first pass's temperature: its gradient is the seed
        surrogate = TokenLoss(_identity, reduction="sum", name="logprob_grad", use_loss_mask=False, temperature=temperature)
        out = self._train(forest, sched, surrogate, w)
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
        self, sched: Schedule, g: int, stack: KVStack, dev: dict, push: bool
    ) -> tuple[torch.Tensor, _GroupAttention]:
        """Run group ``g`` through the model: ([T, hidden] final hidden states, its attend)."""
        r0, r1 = int(sched.row_offsets[g]), int(sched.row_offsets[g + 1])
        plan = sched.groups[g]
        lo, hi = plan.stack_start, plan.stack_start + plan.num_tokens
        seed = stack.has_grad and (not plan.is_leaf or plan.in_call_ancestors)
        attend = _GroupAttention(stack, lo, hi, self._layout(sched, g), self._attention, push, seed)
        checkpoint = (
            torch.is_grad_enabled() and self._step is not None and self._step.checkpoint_layers
            and not self._hf_checkpointing()
        )
        with checkpointed_layers(unwrap(self.module)) if checkpoint else contextlib.nullcontext():
            hidden = self.model.dtree_hidden_states(dev["input_ids"][r0:r1], dev["positions"][r0:r1], attend)
        if push and not all(attend.called):
            missing = [layer for layer, called in enumerate(attend.called) if not called]
            raise RuntimeError(f"layers {missing} never called attend(); every attention layer must")
        return hidden, attend

    def _group_loss(
        self, g: int, hidden: torch.Tensor, terms: LossTerms, dev: dict, per_token: _PerToken, term_log: list,
        head: OutputHead,
    ) -> torch.Tensor | None:
        e0, e1 = int(terms.loss_offsets[g]), int(terms.loss_offsets[g + 1])
        if e1 == e0:
            return None
        p0, p1 = int(terms.pred_offsets[g]), int(terms.pred_offsets[g + 1])
        weighted = weighted_terms(
            per_token.fn,
            hidden,
            dev["pred_hidden_row"][p0:p1],
            dev["labels"][p0:p1],
            dev["loss_pred"][e0:e1],
            dev["weights"][e0:e1],
            {n: f[e0:e1] for n, f in dev["fields"].items()},
            head,
            self.logprob_chunk,
            temperature=per_token.temperature,
            with_entropy=per_token.with_entropy,
        )
        term_log.append((e0, weighted.detach()))
        return weighted.sum()

    def _run_group(self, sched, g, stack, terms, dev, per_token, term_log, head, push: bool) -> _GroupState:
        hidden, attend = self._hidden(sched, g, stack, dev, push=push)
        loss = self._group_loss(g, hidden, terms, dev, per_token, term_log, head)
        # without loss terms, a group's backward only carries its descendants' seeds
        keep_hidden = loss is None and not sched.groups[g].is_leaf and hidden.requires_grad
        return _GroupState(loss=loss, hidden=hidden if keep_hidden else None, pattern=tuple(attend.pattern))

    def _train(
        self, forest: Forest, sched: Schedule, loss: TokenLoss, weights: np.ndarray, return_logprobs: bool = False
    ) -> StepOutput:
        t0 = time.perf_counter()
        terms = select_loss_terms(sched, weights)
        recorded: list[dict] = []  # per call with terms, the loss's per-token metrics (TokenLoss.recording)
        kept: list[tuple] = []  # per call with terms, (logp, entropy) when return_logprobs
        fn = loss.recording(recorded)
        if return_logprobs:
            fn = _keeping(fn, kept)
        per_token = _PerToken(fn, loss.temperature, loss.needs_entropy)
        with GradStash(self.module.parameters()):  # a failed step leaves param.grad as it was
            total, term_log, calls, peak, recomputed = self._walk(
                sched, terms, forest, weights, loss.required_fields, per_token
            )
            loss_value = float(total)  # the step's one device sync
            if not np.isfinite(loss_value):  # any non-finite term makes the sum non-finite
                raise_non_finite(forest, terms.loss_lin, term_log)
        out = StepOutput(
            loss=loss_value,
            num_sequences=forest.num_sequences,
            num_unique_tokens=forest.num_unique_tokens,
            num_linearized_tokens=forest.num_linearized_tokens,
            num_loss_terms=len(terms.loss_lin),
            num_model_calls=calls,
            stack_tokens=sched.stack_tokens,
            peak_graph_tokens=peak,
            seconds=0.0,
            metrics={
                "mode": self.mode,
                "attention": self._attention,
                "groups": sched.num_groups,
                "group_tokens": sched.group_tokens,
                "recomputed_tokens": recomputed,
                "memory_plan": self._step.describe(),
                **self._loss_metrics(loss, forest, terms, term_log, recorded),
            },
        )
        if return_logprobs:
            out.logprobs, out.entropy = self._kept_per_sequence(forest, terms, term_log, kept, loss.needs_entropy)
        out.seconds = time.perf_counter() - t0
        return out

    def _loss_metrics(self, loss: TokenLoss, forest: Forest, terms: LossTerms, term_log: list, recorded: list) -> dict:
        """The loss's metrics: mask-weighted means over the step's loss terms. Each
        call's recorded values pair with its entry of ``term_log`` (both in call order)."""
        if not recorded:
            return {}
        mask = upload(loss.metric_mask(forest)[terms.loss_lin], self._device, compute_dtype(self._dtype))
        sums: dict = {}
        for (e0, weighted), values in zip(term_log, recorded):
            sums = add_metric_sums(sums, masked_metric_sums(values, mask[e0 : e0 + weighted.shape[0]]))
        return metric_means(sums)

    def _kept_per_sequence(
        self, forest: Forest, terms: LossTerms, term_log: list, kept: list, with_entropy: bool
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Scatter each call's kept (logp, entropy) to its terms' linearized positions,
        then split per sequence into [len-1] prediction-aligned tensors (0 where no term)."""
        cdt = compute_dtype(self._dtype)
        lin = upload(terms.loss_lin, self._device)
        lp = torch.zeros(forest.num_linearized_tokens, dtype=cdt, device=self._device)
        ent = torch.zeros_like(lp) if with_entropy else None
        for (e0, weighted), (values, entropies) in zip(term_log, kept):
            where = lin[e0 : e0 + weighted.shape[0]]
            lp[where] = values
            if ent is not None:
                ent[where] = entropies
        pred = upload(prediction_lin(forest), self._device)
        sizes = (forest.sequence_lengths() - 1).tolist()
        return (
            list(torch.split(lp[pred], sizes)),
            list(torch.split(ent[pred], sizes)) if ent is not None else None,
        )

    def _retain_budget(self, sched: Schedule) -> float:
        """Tokens of groups with children whose graphs may be alive at once (see
        :func:`dtree.memory_policy.retain_budget`)."""
        nonleaf = [p.num_tokens for p in sched.groups if not p.is_leaf]
        return memory_policy.retain_budget(
            self._step, self.spec, self.mode, unique_tokens=int(sched.row_offsets[-1]), num_groups=sched.num_groups,
            nonleaf_tokens=int(sum(nonleaf)), nonleaf_groups=len(nonleaf),
        )

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
            _check_grad_pattern(state.pattern, pattern)
            return state

        # the model's attention stays dtree's for the whole step: HF gradient checkpointing
        # re-runs layers inside backward, after the model call has returned
        scope = getattr(self.model, "dtree_scope", None)
        with scope() if scope is not None else contextlib.nullcontext():
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
                        total = self._finish_group(state, total)
                        continue
                    stack.zero_grad(lo, hi)
                    if live_tokens + plan.num_tokens <= budget:
                        live[g] = run(g, push=True, seed=seed)
                        live_tokens += plan.num_tokens
                        peak = max(peak, live_tokens)
                    else:
                        seeds[g] = seed
                        with torch.no_grad(), rng.seeded(seed, device):
                            self._hidden(sched, g, stack, dev, push=True)
                    continue
                if plan.is_leaf:
                    continue
                if g in live:
                    state = live.pop(g)
                    live_tokens -= plan.num_tokens
                else:
                    calls += 1
                    recomputed += plan.num_tokens
                    # K/V are on the stack already and its slots hold the descendants'
                    # gradients: no push, no zeroing. The seed replays the forward's dropout
                    # masks, so the graph is of those K/V.
                    state = run(g, push=False, seed=seeds.pop(g))
                    peak = max(peak, live_tokens + plan.num_tokens)
                total = self._finish_group(state, total)
        return total, term_log, calls, peak, recomputed

    def _finish_group(self, state: _GroupState, total):
        """Backward of one group (see the module docstring); returns the running loss sum."""
        if state.loss is not None:
            total = total + state.loss.detach()
            if state.loss.requires_grad:
                state.loss.backward()
        elif state.hidden is not None:
            state.hidden.backward(torch.zeros_like(state.hidden))
        return total
