"""RuntimeConfig: every option of :class:`dtree.TreeRuntime`, typed and checked in one place.

``TreeRuntime(model, config=RuntimeConfig(mode="retain"))`` and the keyword form
``TreeRuntime(model, mode="retain")`` are the same: the keywords build the config. The
distributed trainer, ``dtree calibrate`` and ``dtree bench`` pass one around instead of
free keyword dicts, so a misspelt option fails where it is written.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Literal, get_args

from .ops.linear_recurrence import BACKENDS as RECURRENCE_BACKENDS
from .ops.stack_attention import BACKENDS

__all__ = ["RuntimeConfig", "Mode", "Attention", "Recurrence", "MODES", "ATTENTIONS", "RECURRENCES"]

Mode = Literal["auto", "retain", "recompute"]
MEMORY_SETTINGS = ("auto", "low")  # or a positive number: a cap in GiB (dtree.plan.memory_policy)
GRAD_GUARDS = (True, False, "device", "host")  # where a step keeps param.grad's old values (dtree.engine.grad_guard)

Attention = Literal["auto", "triton", "flash-attn", "sdpa", "reference"]
Recurrence = Literal["auto", "reference", "chunked", "fla"]
MODES: tuple[str, ...] = get_args(Mode)
ATTENTIONS: tuple[str, ...] = ("auto",) + BACKENDS.names()
RECURRENCES: tuple[str, ...] = ("auto",) + RECURRENCE_BACKENDS.names()


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class RuntimeConfig:
    """The options of :class:`dtree.TreeRuntime` (see its docstring for what each does).

    Attributes:
        mode: ``"auto"``, ``"retain"`` or ``"recompute"``.
        chunk_size: longest segment in tokens (>= 1).
        group_tokens: token budget of one packed model call (>= 0; 0: one segment per
            call); None: the memory policy's choice.
        attention: ``"auto"``, ``"triton"``, ``"sdpa"`` or ``"reference"``.
        recurrence: ``"auto"``, ``"reference"``, ``"chunked"`` or ``"fla"`` (recurrent layers' kernels).
        logprob_chunk: rows per LM-head chunk (>= 1); None: the memory policy's choice.
        stack_capacity: fixed KV-stack size in tokens (>= 1); None sizes it per step.
        progress: a progress bar over each step's model calls.
        checkpoint_layers: per-layer checkpointing: True (every decoder layer), False
            (none), or how many of them (the first ones) in every call; None: the memory
            policy decides.
        memory: ``"auto"``, ``"low"`` or a positive cap in GiB.
        retain_budget_tokens: tokens of groups with children whose graphs retain/auto
            mode may keep alive at once (>= 0); None: the memory policy's budget. A
            small value forces auto mode to recompute (tests use it to cover both).
        deterministic: every dtree kernel runs in a fixed order, so two runs of the same
            forest give bitwise-identical gradients (on the same GPU and software), or
            raises as torch does where one cannot (:mod:`dtree.ops.determinism`); and a
            forest shape keeps its last memory plan while it fits (the plan sets the order
            of the sums). Also on whenever ``torch.use_deterministic_algorithms(True)`` is.
        lean_layers: during dtree's steps, the model's Llama-style RMSNorm and SwiGLU MLP
            modules run dtree's lean kernels (:mod:`dtree.models.lean_layers`: fewer
            launches, ~45% fewer activation bytes per token) and its attention's rotary
            embedding dtree's rotary kernel (:mod:`dtree.ops.rotary`, HF's values), and
            they get their own ``forward`` and function back when the step returns; only
            where those kernels reproduce the modules exactly (Llama, Qwen2, Qwen3,
            Mistral), not in compiled layers, and not where they were applied already.
            False: the model's modules as they are.
        free_after_step: on CUDA, after each call hand the caching allocator's unused
            blocks back to the device (``torch.cuda.empty_cache``), so what the step used
            is free for another process (a colocated inference engine woken between
            micro-batches); the next step then maps its memory again (on an H100: +2.2%
            on the 64k agentic step at 17.6 GiB, +7.7% at 63 GiB, up to +35% on a 0.23 s
            GRPO step). False (default) keeps the blocks cached, as PyTorch training
            loops do, for the trainer to release at a phase boundary. The KV stack is
            dropped after every CUDA call either way, so nothing of dtree's stays
            allocated, and the step reports what is reserved (``StepOutput.metrics["memory"]``).
        pause_gc: Python's automatic garbage collection is off while a training step
            walks and back on when it returns (:mod:`dtree.engine.collector`): collections
            during a step promote its short-lived objects until a full collection of the
            whole process runs (320-370 ms every third step of ``memory="low"`` on the 64k
            agentic tree, H100 host). False: the collector runs as Python schedules it.
        grad_guard: a failed training step (a non-finite loss, an out-of-memory error, a
            loss function's mistake) leaves ``param.grad`` bit for bit as it was: the step
            keeps the gradients already there aside and adds its own at the end
            (:mod:`dtree.engine.grad_guard`). In a gradient-accumulation loop that holds one
            more copy of the gradients during each step after the first (2.9 GiB for
            qwen2.5-1.5b in bf16; the memory policy counts it). Under a memory cap (``memory``
            ``"low"`` or a number) the runtime keeps that copy in pinned host memory instead
            when the device copy would make the step's plan slower (under ``"low"``: larger):
            the step then accumulates in place and a failure copies the old gradients back.
            ``"device"`` and ``"host"`` pick the place. False: the step accumulates into ``param.grad`` in place, as a
            plain PyTorch loop does, and a failed step may leave part of its gradient there
            (its error says so).
        offload_checkpoints: checkpointed decoder layers keep their inputs in pinned host
            memory from the forward to their re-run (:mod:`dtree.models.host_checkpoints`: the
            same bits; copies on a side stream, the layer below prefetched during a layer's
            backward), so a call holds two layer inputs on the device instead of one per layer
            (1 GiB for a 12k-token call of qwen2.5-1.5b). ``"auto"`` (default): on CUDA under
            ``memory="low"``, and under a cap in GiB where its plan is predicted faster than the best
            one that fits with the inputs on the device by more than a 2% margin
            (:data:`dtree.plan.memory_policy.OFFLOAD_COST`: with the attention outputs kept on the host
            beside the inputs the copies cost nothing an H200 run can see, session AD); the policy plans
            with the memory it frees. True: wherever layers are checkpointed (on CPU the inputs are
            cloned: the same steps, for tests); False: never. The pinned pages stay with the
            process for later steps (:func:`dtree.models.host_checkpoints.release_host_pages`).
        keep_attention_outputs: True (default): the memory policy may have checkpointed layers
            keep their stack attention's output and log-sum-exp for their re-run
            (:mod:`dtree.ops.stack_attention.output_memo`: one attention forward less per
            re-run), where the attention backend can and the plan predicts it pays; with the layer
            inputs offloaded (``offload_checkpoints``) the outputs wait on the host with them, and
            ``memory="low"`` keeps them (a call then holds two layers' outputs on the device, and
            the pinned host pages about double: the outputs take as many bytes as the inputs).
            False: never (every re-run runs its attention forward again), for comparison.
        rerun_chunk_rows: the rows per chunk of a checkpointed layer's SwiGLU backward in its re-run
            (:func:`dtree.ops.swiglu.swiglu_down`; >= 0, 0: the whole call at once). None (default):
            the whole call, as the memory policy prices it, except under ``memory="low"``: 4,096-row
            chunks (:data:`dtree.ops.swiglu.interface.CONSUMING_CHUNK_ROWS`), the leanest. Smaller
            chunks hold less (one ``[rows, intermediate]`` buffer) and take more, smaller matmuls whose
            weight gradients add up in float32 (session AF, H200: the 256k tree's capped step 1.3%
            slower with 4,096-row chunks, +0.3 GiB with one; the 64k tree's as fast either way).
        weight_grads_in_matmul: True (default): during a step, the lean layers' projections (q, k, v,
            gate, up, down) add each call's weight gradient into ``param.grad`` inside the matmul that
            computes it (:mod:`dtree.ops.weight_grads`), and their RMSNorm weights and q/k/v biases
            theirs inside the kernel that sums them, instead of handing them to autograd, which adds
            each with a kernel of its own per parameter and call; only for plain leaf parameters without
            hooks, in a plain ``.backward()``. False: autograd accumulates every gradient.
    """

    mode: Mode = "auto"
    chunk_size: int = 2048
    group_tokens: int | None = None
    attention: Attention = "auto"
    recurrence: Recurrence = "auto"
    logprob_chunk: int | None = None
    stack_capacity: int | None = None
    progress: bool = False
    checkpoint_layers: bool | None = None
    memory: str | float = "auto"
    retain_budget_tokens: int | None = None
    deterministic: bool = False
    lean_layers: bool = True
    free_after_step: bool = False
    pause_gc: bool = True
    grad_guard: bool | str = True
    offload_checkpoints: bool | str = "auto"
    keep_attention_outputs: bool = True
    rerun_chunk_rows: int | None = None
    weight_grads_in_matmul: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be 'auto' or one of {BACKENDS.names()}, got {self.attention!r}")
        if self.recurrence not in RECURRENCES:
            raise ValueError(f"recurrence must be one of {RECURRENCES}, got {self.recurrence!r}")
        check_count("chunk_size", self.chunk_size, minimum=1, optional=False)
        check_count("group_tokens", self.group_tokens, minimum=0)
        check_count("logprob_chunk", self.logprob_chunk, minimum=1)
        check_count("stack_capacity", self.stack_capacity, minimum=1)
        check_count("retain_budget_tokens", self.retain_budget_tokens, minimum=0)
        check_count("rerun_chunk_rows", self.rerun_chunk_rows, minimum=0)
        if not (self.memory in MEMORY_SETTINGS or (
            isinstance(self.memory, (int, float)) and not isinstance(self.memory, bool) and self.memory > 0
        )):
            raise ValueError(
                f"memory must be one of {MEMORY_SETTINGS} or a positive number (a cap in GiB), "
                f"got {self.memory!r}"
            )
        layers = self.checkpoint_layers
        if not (layers in (None, True, False) or (_is_int(layers) and layers >= 0)):
            raise ValueError(
                "checkpoint_layers must be None (decided per step), True, False or a number of layers >= 0, "
                f"got {self.checkpoint_layers!r}"
            )
        check_grad_guard(self.grad_guard)
        if not (isinstance(self.offload_checkpoints, bool) or self.offload_checkpoints == "auto"):
            raise ValueError(f"offload_checkpoints must be True, False or 'auto', got {self.offload_checkpoints!r}")
        flags = ("progress", "deterministic", "lean_layers", "free_after_step", "pause_gc", "keep_attention_outputs",
                 "weight_grads_in_matmul")
        for name in flags:
            check_flag(name, getattr(self, name))

    def replace(self, **changes: Any) -> "RuntimeConfig":
        """A copy with ``changes`` applied (and checked)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """The options as a plain dict (for reports)."""
        return dataclasses.asdict(self)


def check_grad_guard(value: Any) -> None:
    """Raise unless ``value`` is one of :data:`GRAD_GUARDS` (True, not 1: the bools by type)."""
    if not (isinstance(value, bool) or value in ("device", "host")):
        raise ValueError(f"grad_guard must be True, False, 'device' or 'host', got {value!r}")


def check_flag(name: str, value: Any) -> None:
    """Raise unless ``value`` is True or False (by type: not 1 or None)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_count(name: str, value: Any, *, minimum: int, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < minimum:
        hint = " or None" if optional else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}, got {value!r}")
