"""TreeRuntime: forward, backward and log-probs over a forest, depth first, with a KV stack.

The walk itself is :class:`dtree.walk.StepWalk` (docs/design.md section 4); the
two-pass path for sequence-level losses is :mod:`dtree.two_pass`; the step skeleton
shared with the baselines is :mod:`dtree.step`; the options are a
:class:`dtree.config.RuntimeConfig`.

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

from typing import Sequence

import numpy as np
import torch

from . import memory_policy
from .checkpointing import decoder_layers
from .checks import check_trainable, model_placement, validate_forest
from .config import RuntimeConfig
from .losses import Normalization, SequenceLoss, TokenLoss
from .models import TreeModule, adapt, unwrap
from .ops.logprobs import OutputHead, as_output_head
from .schedule import LossTerms, Schedule, all_predictions, build_schedule, prediction_lin, select_loss_terms
from .stacks import StepStacks
from .state_plan import plan_states
from .step_plan import hf_checkpointing, new_stack, pick_backend, pick_recurrence, plan_memory, retain_budget
from .step_plan import stack_fits
from .step import KeptLogprobs, StepOutput, StepRun, per_sequence, run_token_step, token_loss_weights
from .tree import Forest
from .two_pass import (
    SequenceLossFn,
    check_temperature,
    logprob_grad_weights,
    logprob_surrogate,
    two_pass_step,
)
from .walk import PerToken, StepArrays, StepWalk

__all__ = ["TreeRuntime", "StepOutput", "RuntimeConfig"]


class TreeRuntime:
    """Tree training for a causal LM.

    Args:
        model: a transformers causal LM (Llama, Qwen2, Qwen3, Mistral, ... any model
            using transformers' attention interface), a PEFT ``PeftModel`` wrapping one,
            either of them ``torch.compile``'d, or a module implementing
            :class:`dtree.models.TreeModule`. Gradients land in ``model``'s parameters.
        config: a :class:`dtree.config.RuntimeConfig`; or pass its fields as keywords
            (``TreeRuntime(model, mode="retain")`` builds the config), not both:
            mode: ``"auto"`` (default), ``"retain"`` or ``"recompute"`` (see module docstring).
            chunk_size: longest segment in tokens; longer trie nodes are split.
            group_tokens: token budget of one packed model call (sibling nodes, nodes of
                different trees and whole small subtrees run together). 0 runs one segment
                per call. None (default): 8192 on CPU; on CUDA the memory policy's choice
                (2048 to 32768).
            attention: ``"auto"`` (``triton`` on CUDA when available, else ``sdpa``),
                ``"triton"``, ``"sdpa"`` or ``"reference"``.
            recurrence: ``"auto"`` (``fla`` on CUDA where installed), ``"fla"`` or ``"reference"``.
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
            retain_budget_tokens: cap on the tokens of groups with children whose graphs
                stay alive at once; None: the memory policy's budget.

    To ``torch.compile`` the decoder layers, call :func:`dtree.compile_layers` on the
    model first (the runtime never recompiles the user's model itself).
    """

    def __init__(self, model: torch.nn.Module, config: RuntimeConfig | None = None, **options) -> None:
        if options.pop("compile", False):
            raise ValueError(
                "TreeRuntime(compile=True) was removed: it recompiled your model in place; call "
                "dtree.compile_layers(model) once, before building the runtime"
            )
        if config is not None and options:
            raise ValueError(f"pass config= or keyword options {sorted(options)}, not both: use config.replace(...)")
        self.config = config if config is not None else RuntimeConfig(**options)
        self.module = model  # the user's object: its parameters get the gradients
        self.model: TreeModule = adapt(model)
        self.spec = self.model.dtree_spec()
        if self.config.checkpoint_layers:
            decoder_layers(unwrap(model))  # raises now, naming the fix, if the layers cannot be found
        self._placement: tuple[torch.device, torch.dtype] | None = None
        self._attention: str | None = None
        self._recurrence: str | None = None
        self._stack: StepStacks | None = None
        self._step: memory_policy.MemoryPlan | None = None  # the last planned step
        if not any(p.device.type == "meta" for p in model.parameters()):
            self._sync_placement()  # an explicit attention backend that cannot run fails here

    # ------------------------------------------------------------------ state
    @property
    def mode(self) -> str:
        return self.config.mode

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
        """Rows per LM-head chunk: the config's value, else the last planned step's."""
        if self.config.logprob_chunk is not None:
            return self.config.logprob_chunk
        return self._step.logprob_chunk if self._step is not None else memory_policy.DEFAULT_LOGPROB_CHUNK

    @property
    def memory_plan(self) -> memory_policy.MemoryPlan | None:
        """The memory policy's decisions for the last planned step (None before one)."""
        return self._step

    @property
    def stack(self) -> StepStacks | None:
        """The KV stacks (one per attention shape) and state stack kept between steps (None
        before the first call or after :meth:`release_memory`). Read-only: the runtime
        reallocates them when needed."""
        return self._stack

    def _sync_placement(self) -> tuple[torch.device, torch.dtype]:
        """Read the model's device and dtype; when they changed since the last call (``model.to(...)``,
        a materialized meta model), pick the backends again (:meth:`_get_stack` reallocates the stacks)."""
        placement = model_placement(self.module.parameters())
        if placement != self._placement:
            self._placement = placement
            self._attention = pick_backend(self.config.attention, placement, self.spec)
            self._recurrence = pick_recurrence(self.config.recurrence, placement, self.spec)
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

    # ------------------------------------------------------------------ planning
    def plan(self, forest: Forest) -> Schedule:
        """Validate ``forest`` against the model and build its schedule."""
        self._sync_placement()
        validate_forest(forest, self.spec)
        self._step = plan_memory(
            self.module, self.spec, self._head(), self.config, self._placement, self._stack, forest
        )
        sched = build_schedule(forest, self.config.chunk_size, self._step.group_tokens)
        capacity = self.config.stack_capacity
        if capacity is not None and sched.stack_tokens > capacity:
            lengths = forest.sequence_lengths()
            s = int(np.argmax(lengths))
            hint = (
                f"the longest path (sequence {s}, {int(lengths[s])} tokens) alone exceeds it"
                if lengths[s] > capacity
                else "lower group_tokens or raise stack_capacity"
            )
            raise ValueError(
                f"this forest needs {sched.stack_tokens} KV-stack slots but stack_capacity is {capacity}: {hint}"
            )
        return sched

    def _get_stack(self, capacity: int, with_grad: bool, state_slots: int = 0) -> StepStacks:
        capacity = max(capacity, self.config.stack_capacity or 0)
        if not stack_fits(self._stack, self.spec, self._placement, capacity, with_grad, state_slots):
            self._stack = None  # free the old buffers before allocating new ones
            self._stack = new_stack(self.spec, self._placement, capacity, with_grad, state_slots)
        return self._stack

    def release_memory(self) -> None:
        """Drop the KV stack buffers (they are kept between steps for reuse)."""
        self._stack = None

    def _head(self) -> OutputHead:
        return as_output_head(self.model.dtree_output_layer())

    def _walk(
        self, forest: Forest, sched: Schedule, terms: LossTerms, weights: np.ndarray | None, field_names: Sequence[str]
    ) -> StepWalk:
        """One walk over ``sched`` (with a stack that takes gradients when ``weights``
        are given: a training walk)."""
        device, dtype = self._placement
        training = weights is not None
        checkpoint = training and self._step.checkpoint_layers and not hf_checkpointing(self.module)
        states = plan_states(sched) if self.spec.recurrent_states else None
        grads = getattr(self.model, "dtree_state_grads", None) if states is not None else None
        return StepWalk(
            model=self.model,
            sched=sched,
            terms=terms,
            arrays=StepArrays.upload(forest, sched, terms, weights, field_names, device, dtype),
            stack=self._get_stack(sched.stack_tokens, training, states.capacity if states is not None else 0),
            head=self._head(),
            attention=self._attention,
            logprob_chunk=self.logprob_chunk,
            device=device,
            dtype=dtype,
            # model calls may draw random numbers (dropout) when any module is in training mode
            randomness=any(m.training for m in self.module.modules()),
            checkpoint_root=unwrap(self.module) if checkpoint else None,
            progress=self.config.progress,
            states=states,
            recurrence=self._recurrence,
            state_grads=None if grads is None else grads(),  # custom modules: every read takes gradients
        )

    # ------------------------------------------------------------------ training
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
            weights = token_loss_weights(forest, loss, normalization)
            return self._train(forest, self.plan(forest), loss, weights, return_logprobs=return_logprobs)
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
        raise TypeError(
            f"loss must be a dtree.losses.TokenLoss, a SequenceLoss or a callable, got {type(loss).__name__}"
        )

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
        temperature = check_temperature(temperature)
        w = logprob_grad_weights(forest, grads)
        return self._backward_from_weights(forest, self.plan(forest), w, loss_value, temperature)

    def _two_pass(self, forest: Forest, loss_fn, temperature: float, return_logprobs: bool) -> StepOutput:
        return two_pass_step(
            forest, self.plan(forest), loss_fn, temperature, return_logprobs,
            logprobs=self._logprobs, backward=self._backward_from_weights, device=self._placement[0],
        )

    def _backward_from_weights(
        self, forest: Forest, sched: Schedule, w: np.ndarray, loss_value: float, temperature: float
    ) -> StepOutput:
        out = self._train(forest, sched, logprob_surrogate(temperature), w)
        out.loss = float(loss_value)
        return out

    def _train(
        self, forest: Forest, sched: Schedule, loss: TokenLoss, weights: np.ndarray, return_logprobs: bool = False
    ) -> StepOutput:
        """One pass of ``loss`` (its [N] ``weights`` given) through :func:`dtree.step.run_token_step`."""
        terms = select_loss_terms(sched, weights)
        kept = KeptLogprobs()

        def run(per_token, recorded) -> StepRun:
            fn = kept.wrap(per_token) if return_logprobs else per_token
            walk = self._walk(forest, sched, terms, weights, loss.required_fields)
            scope = getattr(self.model, "dtree_scope", None)
            budget = retain_budget(self._step, self.spec, self.config, sched)
            res = walk.train(PerToken(fn, loss.temperature, loss.needs_entropy), budget, scope)
            kept.term_log = res.term_log
            metrics = {
                "mode": self.mode,
                "attention": self._attention, "recurrence": self._recurrence,
                "groups": sched.num_groups,
                "group_tokens": sched.group_tokens,
                "recomputed_tokens": res.recomputed_tokens,
                "memory_plan": self._step.describe(),
            }
            return StepRun(
                res.total, res.term_log, res.num_model_calls, res.peak_graph_tokens, sched.stack_tokens, metrics
            )

        device, dtype = self._placement
        out = run_token_step(self.module.parameters(), forest, loss, terms.loss_lin, run, device, dtype)
        if return_logprobs:
            out.logprobs, out.entropy = kept.per_sequence(forest, terms.loss_lin, device, dtype, loss.needs_entropy)
        return out

    # ------------------------------------------------------------------ inference
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
        temperature = check_temperature(temperature)
        return self._logprobs(forest, self.plan(forest), with_entropy, temperature)

    def _logprobs(
        self, forest: Forest, sched: Schedule, with_entropy: bool, temperature: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(per sequence [len-1] log-probs, and entropies when ``with_entropy`` else None)."""
        walk = self._walk(forest, sched, all_predictions(sched), None, ())
        lp_unique, ent_unique = walk.logprobs(forest.num_unique_tokens, temperature, with_entropy)
        targets = forest.lin_unique[prediction_lin(forest)]
        device = self._placement[0]
        lps = per_sequence(forest, lp_unique, targets, device)
        return lps, (per_sequence(forest, ent_unique, targets, device) if with_entropy else None)
