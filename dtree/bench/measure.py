"""Time training steps (forward + backward over a whole forest) of one configuration.

Two protocols:

* :func:`measure_steps` (the default of ``dtree bench``): a fresh forest every step, as
  RL trains. The first and second steps are reported on their own (compilation,
  autotuning, allocator growth, the call sizes dtree adapts after its first step);
  the steady figures are over steps 3..N, each with its own unique-token FLOPs, but a step
  over :data:`dtree.bench.steady.OUTLIER_FACTOR` times their median (a recompilation for a
  new shape, a stalled host), listed in ``steady_outliers`` and left out of every speedup on
  both sides (:mod:`dtree.bench.steady`).
* :func:`measure_method` (``--same-forest``, for kernel work): warm-up steps, then the
  median of repeats on one forest.

Every step has a device sync around it. Peak memory is the device's max allocated
bytes in the step (parameters and gradients included: every method holds them);
``torch.cuda.reset_peak_memory_stats`` runs before each step. Out-of-memory ends the
configuration with ``status="oom"`` and keeps the steps done so far, so the other
configurations still run; any other exception is ``status="error"``.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch

from .steady import steady_split

__all__ = [
    "ALLOCATOR_COUNTERS",
    "MethodResult",
    "allocator_counts",
    "counter_deltas",
    "StepForest",
    "measure_method",
    "measure_steps",
    "peak_tflops",
    "device_name",
    "limit_memory",
    "free_memory",
    "is_out_of_memory",
    "use_expandable_segments",
]

# Dense bf16/fp16 tensor-core peaks (vendor datasheets, TFLOP/s); MFU uses these.
_PEAK_TFLOPS_16BIT = {
    "H200": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 SXM": 989.4,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def limit_memory(device: torch.device, gib: float) -> None:
    """Let this process allocate at most ``gib`` GiB on ``device`` (e.g. to measure an
    80 GB GPU's behaviour on an H200); allocations past it raise out-of-memory."""
    if device.type != "cuda":
        raise ValueError("a memory limit needs a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise ValueError(f"memory limit {gib} GiB exceeds the device's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)


def use_expandable_segments() -> str:
    """Run this process's CUDA caching allocator with ``expandable_segments:True`` (less
    fragmentation: 10.7 GiB of 45.5 reserved were unused at a recompute step's peak on an
    H100 without it). Read when CUDA initializes, so set in the environment before that;
    after, through the allocator's runtime setting (new segments expand). Returns the
    setting in effect, for the report. Applies to every configuration of the run alike."""
    import os

    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        conf = ",".join(filter(None, [conf, "expandable_segments:True"]))
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
        if torch.cuda.is_initialized():
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return conf


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak for ``dtype`` matmuls, or None when unknown (CPU)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_TFLOPS_16BIT.items():
        if key in name:
            return value
    return None


@dataclass
class StepForest:
    """One step's forest with the figures the report needs (computed once, shared by
    every configuration)."""

    seed: int
    forest: Any  # dtree.Forest
    unique_flops: float  # training FLOPs of its unique tokens (ModelSpec.training_flops)
    flop_ratio: float  # FLOP-weighted compression ratio (the ideal speedup over linearized)

    @property
    def unique_tokens(self) -> int:
        return self.forest.num_unique_tokens

    @property
    def linearized_tokens(self) -> int:
        return self.forest.num_linearized_tokens


@dataclass
class MethodResult:
    """One configuration's measurement. In fresh-forest mode ``step_time_s`` is the steady
    mean (steps 3..N); in same-forest mode the median of the repeats."""

    method: str
    status: str  # "ok", "oom", "error" or "skipped"
    config: str | None = None  # the configuration's label (defaults to the method)
    options: dict[str, Any] = field(default_factory=dict)
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # unique tokens / step time
    effective_tokens_per_s: float | None = None  # linearized tokens / step time
    mfu: float | None = None  # FLOPs of the unique tokens / step time / peak
    peak_mem_gib: float | None = None  # max allocated over the measured steps
    peak_reserved_gib: float | None = None  # max reserved by the caching allocator
    loss: float | None = None
    speedup_vs_linearized: float | None = None
    ideal_speedup: float | None = None  # FLOP-weighted compression ratio
    fraction_of_ideal: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    model_calls: int | None = None
    error: str | None = None
    note: str | None = None  # e.g. steps cut by a time budget
    metrics: dict[str, Any] = field(default_factory=dict)
    # fresh-forest mode
    first_step_s: float | None = None
    second_step_s: float | None = None
    steady_max_s: float | None = None
    steady_steps: list[int] = field(default_factory=list)  # 0-based indices of steps 3..N that ran
    steady_outliers: list[int] = field(default_factory=list)  # of steps 3..N, those left out (dtree.bench.steady)
    step_losses: list[float] = field(default_factory=list)
    step_peak_mem_gib: list[float | None] = field(default_factory=list)
    step_calls: list[int | None] = field(default_factory=list)
    # dtree: the memory plan's predicted peak (all allocated memory) and what the step left
    # allocated and reserved after it (StepOutput.metrics["memory"]), per step
    step_predicted_gib: list[float | None] = field(default_factory=list)
    step_held_after_gib: list[float | None] = field(default_factory=list)
    step_reserved_after_gib: list[float | None] = field(default_factory=list)
    allocator: dict[str, int] = field(default_factory=dict)  # cudaMalloc calls, retries, OOMs during the steps

    def __post_init__(self) -> None:
        if self.config is None:
            self.config = self.method

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's ``torch.OutOfMemoryError``, or the CPU allocator's failure (a RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def sync_device(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(runner, forest, loss, model: torch.nn.Module, device: torch.device, *, reset_peak: bool = True,
               zero_grad: bool = True):
    """One ``runner.forward_backward(forest, loss)`` timed between device syncs, after
    ``model.zero_grad(set_to_none=True)`` (unless not ``zero_grad``: the step accumulates onto
    the gradients there, as a micro-batch after the first of an optimizer step does) and
    (``reset_peak``) a reset of the CUDA peak counters. Returns ``(step output, seconds)``;
    every benchmark times a step this way."""
    if zero_grad:
        model.zero_grad(set_to_none=True)
    if reset_peak and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync_device(device)
    t0 = time.perf_counter()
    out = runner.forward_backward(forest, loss)
    sync_device(device)
    return out, time.perf_counter() - t0


def host_timed_step(runtime, forest, loss, model: torch.nn.Module, device: torch.device) -> dict:
    """One ``runtime.forward_backward(forest, loss)`` between device syncs (gradients
    cleared first): wall seconds, the calling thread's CPU seconds (``time.thread_time``:
    the forward, planning, the loss) and the process's (``time.process_time``: also the
    autograd engine's device thread, which runs the backward), the model calls and the
    attention backend they ran."""
    model.zero_grad(set_to_none=True)
    sync_device(device)
    w0, t0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    out = runtime.forward_backward(forest, loss)
    sync_device(device)
    return {"wall": time.perf_counter() - w0, "main_cpu": time.thread_time() - t0,
            "process_cpu": time.process_time() - p0, "calls": out.num_model_calls,
            "attention": out.metrics.get("attention"),
            "rerun_chunk_rows": out.metrics.get("rerun_chunk_rows")}


def median_ms(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls: CUDA events around each call on
    a GPU (its device time, waited for), the host clock elsewhere."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def script_model(smoke: bool, name: str = "qwen2.5-1.5b") -> tuple[torch.nn.Module, torch.device]:
    """A benchmark script's model and device: ``name`` in bf16 on the GPU (with expandable
    segments, as ``dtree bench`` runs), or the tiny model in float32 on the CPU when ``smoke``
    or without a GPU."""
    from ..presets import build_model

    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if device.type == "cuda":
        use_expandable_segments()
    return build_model("tiny" if device.type == "cpu" else name, dtype=dtype, device=device), device


def emit_report(text: str, filename: str) -> None:
    """Print a script's Markdown report, and write it to ``$OUT/filename`` when OUT is set."""
    print(text, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], filename), "w") as f:
            f.write(text + "\n")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


ALLOCATOR_COUNTERS = {"num_device_alloc": "cuda_mallocs", "num_alloc_retries": "alloc_retries", "num_ooms": "ooms"}


def allocator_counts(device: torch.device, counters: Mapping[str, str] = ALLOCATOR_COUNTERS) -> dict[str, int]:
    """The CUDA caching allocator's cumulative ``counters`` (``memory_stats`` key -> name) on ``device``;
    empty off CUDA. Every benchmark reads them here; :func:`counter_deltas` takes a missing name as 0."""
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else None
    return {name: int(stats.get(key, 0)) for key, name in counters.items()} if stats is not None else {}


def counter_deltas(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in {**before, **after}}  # a missing name counts 0


def measure_method(
    name: str,
    make_runner: Callable[[], Any],
    forest,
    loss,
    model: torch.nn.Module,
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    unique_flops: float,
    peak: float | None,
    on_step: Callable[[], None] | None = None,
    config: str | None = None,
    options: dict[str, Any] | None = None,
) -> MethodResult:
    """Same-forest protocol: ``warmup + repeats`` steps of
    ``make_runner().forward_backward(forest, loss)``; the median of the repeats."""
    free_memory(device)
    result = MethodResult(method=name, status="ok", config=config, options=dict(options or {}))
    runner = None
    try:
        runner = make_runner()
        times, out = [], None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(warmup + repeats):
            out, dt = timed_step(runner, forest, loss, model, device, reset_peak=i == warmup)
            if i >= warmup:
                times.append(dt)
            if on_step:
                on_step()
        result.step_times_s = times
        result.step_time_s = statistics.median(times)
        result.loss = float(out.loss)
        result.model_calls = getattr(out, "num_model_calls", None)
        result.metrics = dict(getattr(out, "metrics", {}) or {})
        result.tokens_per_s = forest.num_unique_tokens / result.step_time_s
        result.effective_tokens_per_s = forest.num_linearized_tokens / result.step_time_s
        if peak:
            result.mfu = unique_flops / result.step_time_s / (peak * 1e12)
        if device.type == "cuda":
            result.peak_mem_gib = torch.cuda.max_memory_allocated(device) / 2**30
            result.peak_reserved_gib = torch.cuda.max_memory_reserved(device) / 2**30
    except Exception as e:  # reported, so one broken method does not hide the others
        result.status = "oom" if is_out_of_memory(e) else "error"
        result.error = _first_line(e)
    finally:
        runner = None
        model.zero_grad(set_to_none=True)
        free_memory(device)
    return result


def measure_steps(
    config: str,
    method: str,
    make_runner: Callable[[], Any],
    forests: list[StepForest],
    loss,
    model: torch.nn.Module,
    *,
    device: torch.device,
    peak: float | None,
    options: dict[str, Any] | None = None,
    on_step: Callable[[int, float, "MethodResult"], None] | None = None,
    deadline: float | None = None,
    max_seconds: float | None = None,
    accumulate: bool = False,
) -> MethodResult:
    """Fresh-forest protocol: one step on each of ``forests`` in order, with one runner
    (as a training loop keeps its trainer). ``accumulate``: the gradients are cleared
    before the first step only, so every later step adds to them (the micro-batches of one
    long optimizer step: what gradient accumulation holds in memory).

    ``deadline`` (``time.monotonic()`` value): no step starts after it; the
    configuration is ``skipped`` if it ran none. ``max_seconds``: stop this
    configuration once its steps took that long and at least 3 ran (so a steady
    figure exists). Either cut is written in ``note``. ``on_step(i, seconds, result)``
    runs after every step (progress lines).
    """
    free_memory(device)
    result = MethodResult(method=method, status="ok", config=config, options=dict(options or {}))
    runner = out = None
    spent = 0.0
    before = allocator_counts(device)
    try:
        runner = make_runner()
        for i, sf in enumerate(forests):
            if deadline is not None and time.monotonic() > deadline:
                result.note = f"time budget spent: ran {i} of {len(forests)} steps"
                break
            if max_seconds is not None and spent >= max_seconds and i >= 3:
                result.note = f"stopped after {i} of {len(forests)} steps ({spent:.0f} s >= {max_seconds:g} s per configuration)"
                break
            out, dt = timed_step(runner, sf.forest, loss, model, device, zero_grad=i == 0 or not accumulate)
            spent += dt
            result.step_times_s.append(dt)
            result.step_losses.append(float(out.loss))
            result.step_calls.append(getattr(out, "num_model_calls", None))
            result.step_peak_mem_gib.append(
                torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            )
            if device.type == "cuda":
                reserved = torch.cuda.max_memory_reserved(device) / 2**30
                result.peak_reserved_gib = max(result.peak_reserved_gib or 0.0, reserved)
            result.metrics = dict(getattr(out, "metrics", {}) or {})
            _record_memory(result, result.metrics)
            if on_step:
                on_step(i, dt, result)
    except Exception as e:  # reported, so one broken configuration does not hide the others
        result.status = "oom" if is_out_of_memory(e) else "error"
        result.error = f"step {len(result.step_times_s) + 1}: {_first_line(e)}"
    finally:
        runner = out = None
        model.zero_grad(set_to_none=True)
        free_memory(device)
    result.allocator = counter_deltas(before, allocator_counts(device))
    if result.status == "ok" and not result.step_times_s:
        result.status = "skipped"
    _summarize_steps(result, forests, peak)
    return result


def _record_memory(result: MethodResult, metrics: dict) -> None:
    """A step's predicted peak and what it left on the device (None where the method
    reports neither)."""
    plan = metrics.get("memory_plan") or {}
    after = metrics.get("memory") or {}
    result.step_predicted_gib.append(plan.get("predicted_total_gib"))
    result.step_held_after_gib.append(after.get("allocated_after_gib"))
    result.step_reserved_after_gib.append(after.get("reserved_after_gib"))


def _summarize_steps(result: MethodResult, forests: list[StepForest], peak: float | None) -> None:
    """First, second and steady figures from the steps that ran."""
    times = result.step_times_s
    if not times:
        return
    result.first_step_s = times[0]
    result.second_step_s = times[1] if len(times) > 1 else None
    result.loss = result.step_losses[-1]
    result.model_calls = result.step_calls[-1]
    mems = [m for m in result.step_peak_mem_gib if m is not None]
    result.peak_mem_gib = max(mems) if mems else None
    result.steady_steps, result.steady_outliers = steady_split(times)
    if not result.steady_steps:
        return
    steady = [times[i] for i in result.steady_steps]
    total = sum(steady)
    result.step_time_s = total / len(steady)
    result.steady_max_s = max(steady)
    result.tokens_per_s = sum(forests[i].unique_tokens for i in result.steady_steps) / total
    result.effective_tokens_per_s = sum(forests[i].linearized_tokens for i in result.steady_steps) / total
    result.ideal_speedup = statistics.fmean(forests[i].flop_ratio for i in result.steady_steps)
    if peak:
        result.mfu = sum(forests[i].unique_flops for i in result.steady_steps) / total / (peak * 1e12)
