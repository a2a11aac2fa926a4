"""TreeRuntime: forward, backward and log-probs over a forest, depth first, with a KV stack.

A *step* is one call (``forward_backward``, ``logprobs``, ...); it reads top-down::

    check    the arguments and the model's state, on the host (:mod:`dtree.engine.checks`)
    weights  the loss's [N] per-term weights (``loss.prepare``)
    plan     a :class:`dtree.plan.step_plan.StepPlan`, built once by the
             :class:`~dtree.plan.step_plan.StepPlanner`: memory plan, schedule, loss terms,
             stacks, device arrays, retain budget
    walk     :class:`dtree.engine.walk.TreeWalk` reads the plan (docs/design.md section 4)
    finish   one device sync, the output (:class:`dtree.engine.step.TokenStep`)

The two-pass path for sequence-level losses is two such walks (log-probs, then
training) around the host step of :mod:`dtree.engine.two_pass`; the options are a
:class:`dtree.config.RuntimeConfig`.

Gradient seeds enter where K/V are consumed, inside whatever graph computed them, so any
checkpointing inside the model works: dtree's own per-layer checkpointing
(``checkpoint_layers``) and HF's gradient checkpointing re-run a layer in backward,
re-push its K/V (the same values, into the slots it holds) and seed the re-run K/V.
A frozen layer's K/V (no graph) simply drop their seed: nothing trainable computes them.

Modes:
    retain     the graphs of the groups on the current path stay alive between
               forward(g) and backward(g). Activation memory ~ the path, not the tree.
    recompute  forward(g) runs without grad (it only pushes K/V); backward(g) re-runs
               g with grad and backpropagates at once.
    auto       the memory policy (:mod:`dtree.plan.memory_policy`) decides per step; on CPU,
               retain.

In every mode a group without children (leaves only) runs once, with grad, and
backpropagates at once: nothing reads its K/V, so it is neither pushed nor recomputed.

Exactness: parameter gradients equal those of linearized training on every sequence
with the same loss, up to floating-point rounding (tests/test_runtime_exact.py checks
every parameter against HF run per path).

Randomness (dropout in LoRA adapters, residual streams, custom modules): every group's
forward runs with its own generator state, seeded from one draw of the global CPU
generator (:mod:`dtree.device.rng`), and a recomputed group replays it; the LM head's module
path replays its own draws in backward. So retain, recompute and auto give the same
gradients under the same ``torch.manual_seed``. Attention-probability dropout is
refused (the stack attention does not implement it).

Memory (``memory="auto" | "low" | GiB``, :mod:`dtree.plan.memory_policy`): per step, from
the model's shape and dtype, the bytes its calls keep per token (measured once per
model state, :mod:`dtree.plan.memory_probe`), the memory free at the call and the forest's
size: the call size, how many decoder layers a call checkpoints, how the path's groups
with children are kept (their layers checkpointed or not) or recomputed, the LM-head
chunk; explicit arguments win. On CUDA the KV stack is dropped after every call, and
with ``free_after_step`` the allocator's cache is emptied too (:mod:`dtree.engine.step_memory`).

Model state is read at every call, not at construction: device and dtype (the KV stack
is reallocated when they change), the LM head (adapters injected later), HF gradient
checkpointing (the step runs inside the adapter's attention scope, so HF's re-run
layers in backward attend through the stack), attention dropout.

Errors: inputs are validated on the host before any kernel runs. A non-finite loss is
detected at the end of the step with a single device sync; ``param.grad`` is then
restored to what it was before the call (unless ``grad_guard=False``: the step then
accumulates in place, :mod:`dtree.engine.grad_guard`) and a ``ValueError`` names the
sequence and position of the first bad term.

Micro-batches: :meth:`TreeRuntime.forward_backward_micro_batches` runs an optimizer step's
micro-batches, each planned while the one before still runs (:mod:`dtree.engine.micro_batches`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from ..config import RuntimeConfig
from ..forest.forest import Forest
from ..losses import LogprobLoss, Normalization, SequenceLoss, TokenLoss
from ..models import TreeModule, adapt, unwrap
from ..models.checkpointing import decoder_layers
from ..models.lean_layers import lean_layers_during
from ..ops.backward_once import backward_once_scope
from ..plan.memory_policy import MemoryPlan
from ..plan.model_view import ModelView, model_view
from ..plan.schedule import Schedule
from ..plan.step_plan import StepPlan, StepPlanner
from ..stacks.step_stacks import StepStacks
from .checks import (
    check_forest,
    check_loss_argument,
    check_normalization,
    check_training_call,
    checked_step_loss,
    validate_forest,
)
from .micro_batches import run_micro_batches
from .step import StepOutput
from .step_memory import after_step, drops_stack, with_report
from .two_pass import (
    LogprobGrads,
    SequenceLossFn,
    check_temperature,
    host_step,
    logprob_grad_weights,
    loss_temperature,
    needs_entropy,
    surrogate,
    two_pass_output,
)
from .walk import TreeWalk, train_step

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
            it runs, else ``chunked``; ``reference`` on CPU),
            ``logprob_chunk`` (LM-head rows per chunk), ``checkpoint_layers`` (True, False or
            how many decoder layers to checkpoint in every call; None: the policy's
            choice), ``memory`` (``"auto"``, ``"low"`` or a cap in GiB on the step's peak),
            ``stack_capacity``, ``progress``, ``retain_budget_tokens``, ``free_after_step``,
            ``deterministic`` (bitwise-identical gradients in every run; :mod:`dtree.ops.determinism`),
            ``lean_layers`` (the model's norms and MLPs run dtree's lean kernels during
            its steps; :mod:`dtree.models.lean_layers`), ``pause_gc`` (Python's automatic
            garbage collection off during a training step; :mod:`dtree.engine.collector`),
            ``grad_guard`` (a failed step leaves ``param.grad`` as it was, at one more copy of
            the gradients while accumulating, kept in pinned host memory under a memory cap
            when that is faster; :mod:`dtree.engine.grad_guard`).

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
        self._planner: StepPlanner = StepPlanner(self.module, self.model, self.spec, self.config)
        if not any(p.device.type == "meta" for p in model.parameters()):
            self._planner.sync()  # an explicit attention backend that cannot run fails here

    # ------------------------------------------------------------------ state
    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def device(self) -> torch.device:
        """The model's device now (read from its parameters at every call)."""
        return self._planner.sync()[0]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype now (read from its parameters at every call)."""
        return self._planner.sync()[1]

    @property
    def attention(self) -> str:
        """The attention backend for the model's current device and dtype."""
        self._planner.sync()
        return self._planner.attention

    @property
    def logprob_chunk(self) -> int:
        """Rows per LM-head chunk: the config's value, else the last planned step's."""
        return self._planner.logprob_chunk

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """The memory policy's decisions for the last planned step (None before one)."""
        return self._planner.memory_plan

    @property
    def stack(self) -> StepStacks | None:
        """The KV stacks (one per attention shape) and state stack kept between steps (None
        before the first call or after :meth:`release_memory`). Read-only: the runtime
        reallocates them when needed."""
        return self._planner.stack

    def _check_call(self, training: bool, view: ModelView) -> None:
        """Host-side checks of the model's state at every call, before anything is
        allocated: for training, grad mode on (not under ``torch.no_grad()`` or
        ``torch.inference_mode()``) and a trainable parameter; placement; what the
        adapter refuses (attention dropout)."""
        if training:
            check_training_call(view.parameters)
        self._planner.sync(view)
        check = getattr(self.model, "dtree_check", None)
        if check is not None:
            check(training)

    def plan(self, forest: Forest) -> Schedule:
        """Validate ``forest`` against the model and build its schedule."""
        self._planner.sync()
        validate_forest(forest, self.spec)
        return self._planner.schedule(forest)

    def release_memory(self) -> None:
        """Drop the KV stack buffers (on CUDA the runtime drops them after every call;
        elsewhere they are kept for the next step), also those the last step's plan holds."""
        if self._planner.stack is not None:
            self._planner.stack.release()
        self._planner.stack = None

    @contextlib.contextmanager
    def _call(self, training: bool) -> Iterator[tuple[ModelView, dict]]:
        """A call's body: the model viewed once (:func:`dtree.plan.model_view.model_view`:
        its modules and parameters, which the checks, the plan, the lean layers and the
        step's gradient stash all read) and checked (:meth:`_check_call`), inside
        :meth:`_released`; yields (the view, the memory report's dict). A training call's graphs are
        back-propagated once, by the walk (:mod:`dtree.ops.backward_once`)."""
        view = model_view(self.module)
        with self._released(view.modules) as after, backward_once_scope(training):
            self._check_call(training, view)
            yield view, after

    @contextlib.contextmanager
    def _released(self, modules: Sequence[torch.nn.Module] | None = None) -> Iterator[dict]:
        """The call's body, with the model's norms and MLPs lean when ``lean_layers``
        (:func:`dtree.models.lean_layers.lean_layers_during`; ``modules``: the model's, when
        already walked); then, also when it fails, on CUDA: the stacks dropped, the
        allocator's cache emptied when ``free_after_step``, reported into the yielded dict
        (:mod:`dtree.engine.step_memory`)."""
        after: dict = {}
        try:
            with lean_layers_during(self.module, self.config.lean_layers, modules):
                yield after
        finally:
            device = self._planner.placement[0] if self._planner.placement else None
            if drops_stack(device):
                self.release_memory()
            after.update(after_step(device, self.config.free_after_step))

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
        was in every case (:mod:`dtree.engine.checks`, :class:`dtree.engine.step.TokenStep`).
        """
        check_forest(forest)
        check_loss_argument(loss)
        check_normalization(normalization)
        with self._call(training=True) as (view, after):
            if isinstance(loss, TokenLoss):
                out = self._train(self._token_plan(forest, loss, normalization, view), view, return_logprobs)
            else:  # pass 1 of two (dtree.engine.two_pass): the log-probs, then the loss's gradient on the host
                validate_forest(forest, self.spec)
                loss = checked_step_loss(loss, forest, normalization)
                plan = self._planner.make_plan(forest, view=view)
                lps, ents = TreeWalk(plan).logprobs(loss_temperature(loss), needs_entropy(loss), rewind_rng=True)
                first = host_step(loss, forest, lps, ents)
                forest, trained, weights = surrogate(forest, first.grads)
                plan = self._planner.make_plan(forest, weights, trained.field_names, True, view)
                out = two_pass_output(self._train((plan, trained), view, False), loss, first, return_logprobs)
        return with_report(out, after, self.memory_plan)

    def forward_backward_micro_batches(
        self,
        forests: Sequence[Forest],
        loss: TokenLoss | SequenceLoss | LogprobLoss | SequenceLossFn,
        *,
        normalization: Normalization | None = None,
        return_logprobs: bool = False,
    ) -> list[StepOutput]:
        """:meth:`forward_backward` over each of ``forests``, the micro-batches of one optimizer
        step, in order: their gradients accumulate into ``param.grad`` (the same as one call per
        forest), reduced over all of them (``normalization`` defaults to
        ``Normalization.from_forests(forests, loss)``; a plain callable normalizes itself).

        For a :class:`dtree.losses.TokenLoss` the host prepares each micro-batch (checks, the
        loss's weights, the memory plan, the schedule, the uploads) while the GPU still runs
        the one before (:mod:`dtree.engine.micro_batches`), and the model is walked, checked and
        given its lean layers once for all of them; other losses run one ``forward_backward``
        each. Returns one :class:`StepOutput` per forest; ``metrics["memory"]`` (what the call
        left allocated) is on the last. Errors are :meth:`forward_backward`'s, raised with a
        note naming the micro-batch; the micro-batches before it stay in ``param.grad``.
        """
        forests = list(forests)
        if not forests:
            raise ValueError("forests is empty: pass the micro-batches of one optimizer step (dtree.Forest each)")
        for forest in forests:
            check_forest(forest)
        check_loss_argument(loss)
        check_normalization(normalization)
        if normalization is None and isinstance(loss, (TokenLoss, SequenceLoss)):
            normalization = Normalization.from_forests(forests, loss)
        if not isinstance(loss, TokenLoss):
            def one(k, forest, _):
                return self.forward_backward(forest, loss, normalization=normalization, return_logprobs=return_logprobs)
            return run_micro_batches(len(forests), lambda k, _: forests[k], one)
        with self._call(training=True) as (view, after):
            outs = run_micro_batches(
                len(forests),
                lambda k, releasing: self._token_plan(forests[k], loss, normalization, view, releasing),
                lambda k, planned, ahead: self._train(planned, view, return_logprobs, ahead),
            )
        with_report(outs[-1], after, self.memory_plan)
        return outs

    def _token_plan(self, forest: Forest, loss: TokenLoss, normalization: Normalization | None, view: ModelView,
                    releasing: float = 0.0) -> tuple[StepPlan, TokenLoss]:
        """(the plan, the checked loss) of a step of ``loss`` over ``forest``: the forest checked
        against the model, the loss's fields and weights (:meth:`TokenLoss.prepare`), the step
        plan (``releasing``: :meth:`StepPlanner.make_plan`'s)."""
        validate_forest(forest, self.spec)
        loss = checked_step_loss(loss, forest, normalization)
        forest, weights = loss.prepare(forest, normalization)
        return self._planner.make_plan(forest, weights, loss.field_names, view=view, releasing=releasing), loss

    def _train(self, planned: tuple[StepPlan, TokenLoss], view: ModelView, return_logprobs: bool,
               before_sync=None) -> StepOutput:
        """The training walk of a plan and its loss (:func:`dtree.engine.walk.train_step`) with the
        runtime's options."""
        plan, loss = planned
        return train_step(plan, loss, view.parameters, self._scope(), return_logprobs, self.config.pause_gc,
                          plan.memory.grad_guard, before_sync, self.config.weight_grads_in_matmul)

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
        with self._call(training=True) as (view, after):
            w = logprob_grad_weights(forest, grads)
            w_entropy = None if entropy_grads is None else logprob_grad_weights(forest, entropy_grads)
            validate_forest(forest, self.spec)
            grads = LogprobGrads(float(loss_value), check_temperature(temperature), w, w_entropy)
            forest, loss, weights = surrogate(forest, grads)
            plan = self._planner.make_plan(forest, weights, loss.field_names, view=view)
            out = train_step(plan, loss, view.parameters, self._scope(), pause_gc=self.config.pause_gc,
                             grad_guard=plan.memory.grad_guard,
                             weight_grads_in_matmul=self.config.weight_grads_in_matmul)
            out.loss = grads.value
        return with_report(out, after, self.memory_plan)

    def _scope(self):
        """The model adapter's attention scope, kept open over a training walk (None: none)."""
        return getattr(self.model, "dtree_scope", None)

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
        """check -> plan -> the log-prob walk."""
        check_forest(forest)
        with self._call(training=False) as (view, _):
            validate_forest(forest, self.spec)
            plan = self._planner.make_plan(forest, view=view)
            return TreeWalk(plan).logprobs(check_temperature(temperature), with_entropy)
