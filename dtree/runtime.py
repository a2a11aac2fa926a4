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
               g with grad and backpropagates at once.
    auto       the memory policy (:mod:`dtree.memory_policy`) decides per step; on CPU,
               retain.

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

Memory (``memory="auto" | "low" | GiB``, :mod:`dtree.memory_policy`): per step, from
the model's shape and dtype, the bytes its calls keep per token (measured once per
model state, :mod:`dtree.memory_probe`), the memory free at the call and the forest's
size: the call size, how many decoder layers a call checkpoints, how the path's groups
with children are kept (their layers checkpointed or not) or recomputed, the LM-head
chunk; explicit arguments win. On CUDA the KV stack and the allocator's cache are
released after every call (``free_after_step``, :mod:`dtree.step_memory`).

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
from .checks import check_forest, check_loss_argument, check_normalization, check_training_call
from .checks import model_placement, validate_forest
from .config import RuntimeConfig
from .losses import LogprobLoss, Normalization, SequenceLoss, TokenLoss
from .models import TreeModule, adapt, unwrap
from .ops import determinism, stack_ops
from .ops.logprobs import OutputHead, as_output_head
from .schedule import LossTerms, Schedule, all_predictions, build_schedule, prediction_lin, select_loss_terms
from .stacks import StepStacks
from .state_plan import StatePlan, plan_states
from .step_plan import (
    checkpoint_root, measured_call_bytes, new_stack, pick_backend, pick_recurrence, plan_memory, refine_plan,
    retain_budget, stack_fits,
)
from .step_memory import released
from .step import KeptLogprobs, StepOutput, StepRun, per_sequence, run_token_step, token_loss_weights
from .tree import Forest
from .two_pass import (
    SequenceLossFn,
    check_temperature,
    logprob_grad_weights,
    logprob_entropy_surrogate,
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
        config: a :class:`dtree.config.RuntimeConfig` (each option documented there); or
            pass its fields as keywords (``TreeRuntime(model, mode="retain")`` builds the
            config), not both: ``mode`` (``"auto"``, ``"retain"``, ``"recompute"``),
            ``chunk_size`` (longest segment), ``group_tokens`` (tokens per model call; 0:
            one segment per call; None: 8192 on CPU, the memory policy's choice on CUDA),
            ``attention`` (``"auto"``: ``triton`` on CUDA where it runs, else ``sdpa``),
            ``recurrence`` (recurrent layers' kernels; ``"auto"``: ``fla`` on CUDA where
            installed, else ``reference``),
            ``logprob_chunk`` (LM-head rows per chunk), ``checkpoint_layers`` (True, False or
            how many decoder layers to checkpoint in every call; None: the policy's
            choice), ``memory`` (``"auto"``, ``"low"`` or a cap in GiB on the step's peak),
            ``stack_capacity``, ``progress``, ``retain_budget_tokens``, ``free_after_step``,
            ``deterministic`` (bitwise-identical gradients in every run; :mod:`dtree.ops.determinism`).

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
        self._deterministic = False  # deterministic mode as the backend was picked for
        self._attention: str | None = None
        self._recurrence: str | None = None
        self._stack: StepStacks | None = None
        self._step: memory_policy.MemoryPlan | None = None  # the last planned step
        self._call_bytes: dict = {}  # measured per-token call figures, per model state (step_plan)
        self._states: tuple[Schedule, StatePlan | None] | None = None  # the last schedule's state slots
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
        deterministic = determinism.requested(self.config.deterministic)  # torch's mode may change between calls
        if placement != self._placement or deterministic != self._deterministic:
            self._placement, self._deterministic = placement, deterministic
            self._attention = pick_backend(self.config.attention, placement, self.spec, deterministic)
            self._recurrence = pick_recurrence(self.config.recurrence, placement, self.spec, deterministic)
            if deterministic:
                stack_ops.note_missing_extension(placement[0])
        return placement

    def _check_call(self, training: bool) -> None:
        """Host-side checks of the model's state at every call, before anything is
        allocated: for training, grad mode on (not under ``torch.no_grad()`` or
        ``torch.inference_mode()``) and a trainable parameter; placement; what the
        adapter refuses (attention dropout)."""
        if training:
            check_training_call(self.module.parameters())
        self._sync_placement()
        check = getattr(self.model, "dtree_check", None)
        if check is not None:
            check(training)

    # ------------------------------------------------------------------ planning
    def plan(self, forest: Forest) -> Schedule:
        """Validate ``forest`` against the model and build its schedule."""
        self._sync_placement()
        validate_forest(forest, self.spec)
        call_bytes = measured_call_bytes(
            self.module, self.model, self.spec, self._placement, self._attention, self._call_bytes, self._recurrence
        )
        self._step = plan_memory(
            self.module, self.spec, self._head(), self.config, self._placement, self._stack, forest, call_bytes
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
        states = self._state_plan(sched)
        self._step = refine_plan(self._step, sched, self.config, self._stack, states.capacity if states else 0)
        return sched

    def _state_plan(self, sched: Schedule) -> StatePlan | None:
        """The state slots of ``sched`` (None for a model without recurrent layers), planned once per schedule."""
        if self._states is None or self._states[0] is not sched:
            self._states = (sched, plan_states(sched) if self.spec.recurrent_states else None)
        return self._states[1]

    def _get_stack(self, capacity: int, with_grad: bool, state_slots: int = 0) -> StepStacks:
        capacity = max(capacity, self.config.stack_capacity or 0)
        if not stack_fits(self._stack, self.spec, self._placement, capacity, with_grad, state_slots):
            self._stack = None  # free the old buffers before allocating new ones
            self._stack = new_stack(self.spec, self._placement, capacity, with_grad, state_slots)
        return self._stack

    def release_memory(self) -> None:
        """Drop the KV stack buffers (kept between steps for reuse with
        ``free_after_step=False``; on CUDA the runtime drops them after every call by
        default)."""
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
        root = checkpoint_root(self.module) if training else None
        states = self._state_plan(sched)
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
            checkpoint_root=root,
            checkpoint_layers=self._step.checkpoint_layers if root is not None else 0,
            path_checkpoint_layers=max(0, self._step.path_checkpoint_layers) if root is not None else 0,
            progress=self.config.progress,
            deterministic=self._deterministic,
            states=states,
            recurrence=self._recurrence,
            state_grads=None if grads is None else grads(),  # custom modules: every read takes gradients
        )

    # ------------------------------------------------------------------ training
    def forward_backward(
        self,
        forest: Forest,
        loss: TokenLoss | SequenceLoss | LogprobLoss | SequenceLossFn,
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
                that are not sums of per-token terms; a ``SequenceLoss``'s log-probs are at its
                ``temperature``, a :class:`dtree.LogprobLoss`'s too (entropies too), a plain callable's at 1.
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

        Raises ``TypeError`` for arguments of the wrong kind (not a Forest, an uncalled
        loss factory such as ``dtree.losses.ppo_clip``, a normalization that is not a
        :class:`Normalization`) and ``ValueError`` for bad values (grad mode off, ids
        outside the vocabulary, missing fields, ...), on the host before any kernel; a
        loss function's own mistakes (a field it did not get, numpy or a detached tensor
        returned) and a non-finite loss during the step. ``param.grad`` is left as it
        was in every case (:mod:`dtree.checks`, :func:`dtree.step.checked_loss`).
        """
        check_forest(forest)
        check_loss_argument(loss)
        check_normalization(normalization)
        return self._released(lambda: self._forward_backward(forest, loss, normalization, return_logprobs))

    def _forward_backward(self, forest, loss, normalization, return_logprobs: bool) -> StepOutput:
        self._check_call(training=True)
        if isinstance(loss, TokenLoss):
            forest, weights = token_loss_weights(forest, loss, normalization)
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
        if normalization is not None:  # check_loss_argument left a LogprobLoss or a plain callable
            raise ValueError(
                "normalization= applies to a TokenLoss or a dtree.losses.SequenceLoss; a plain two-pass callable "
                "fn(logprobs, forest) divides by whatever it chooses: normalize inside it, or wrap its per-token "
                "terms in a SequenceLoss"
            )
        return self._two_pass(forest, loss, getattr(loss, "temperature", 1.0), return_logprobs)

    def backward_from_logprob_grads(
        self,
        forest: Forest,
        grads: Sequence[torch.Tensor | None],
        *,
        loss_value: float = float("nan"),
        temperature: float = 1.0,
        entropy_grads: Sequence[torch.Tensor | None] | None = None,
    ) -> StepOutput:
        """Second pass of the two-pass path: one DFS backward with ``d loss / d logprobs``.

        Args:
            grads: per sequence, [len - 1] gradients of the loss w.r.t. the log-probs
                :meth:`logprobs` returned (None for a sequence the loss ignores).
            loss_value: reported as ``StepOutput.loss``.
            temperature: the temperature those log-probs were computed at (the
                gradient flows through ``softmax(logits / temperature)``).
            entropy_grads: likewise w.r.t. the entropies :meth:`entropy` returned, or None.
        """
        check_forest(forest)

        def run() -> StepOutput:
            self._check_call(training=True)
            w = logprob_grad_weights(forest, grads)
            w_entropy = None if entropy_grads is None else logprob_grad_weights(forest, entropy_grads)
            return self._backward_from_weights(
                forest, self.plan(forest), w, loss_value, check_temperature(temperature), w_entropy
            )

        return self._released(run)

    def _released(self, run):
        """``run()``, then what ``free_after_step`` releases (:func:`dtree.step_memory.released`)."""
        return released(run, self._placement, self.release_memory, self.config.free_after_step, lambda: self._step)

    def _two_pass(self, forest: Forest, loss_fn, temperature: float, return_logprobs: bool) -> StepOutput:
        return two_pass_step(
            forest, self.plan(forest), loss_fn, temperature, return_logprobs,
            logprobs=self._logprobs, backward=self._backward_from_weights, device=self._placement[0],
        )

    def _backward_from_weights(
        self, forest: Forest, sched: Schedule, w: np.ndarray, loss_value: float, temperature: float,
        w_entropy: np.ndarray | None = None,
    ) -> StepOutput:
        if w_entropy is None or not w_entropy.any():
            out = self._train(forest, sched, logprob_surrogate(temperature), w)
        else:
            forest, surrogate, weights = logprob_entropy_surrogate(forest, w, w_entropy, temperature)
            out = self._train(forest, sched, surrogate, weights)
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
            walk = self._walk(forest, sched, terms, weights, loss.field_names)
            scope = getattr(self.model, "dtree_scope", None)
            budget = retain_budget(self._step, self.config)
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
        check_forest(forest)

        def run():
            self._check_call(training=False)
            return self._logprobs(forest, self.plan(forest), with_entropy, check_temperature(temperature))

        return self._released(run)

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
