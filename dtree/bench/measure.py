"""Time one training step (forward + backward over the whole forest) of a method.

Wall time per step is measured after warm-up, median of repeats, with a device sync
around each step. Peak memory is the device's max allocated bytes during the timed
steps (parameters and gradients included, since every method holds them).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

__all__ = ["MethodResult", "measure_method", "peak_tflops", "device_name", "limit_memory"]

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
class MethodResult:
    method: str
    status: str  # "ok", "oom" or "error"
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # unique tokens / step time
    effective_tokens_per_s: float | None = None  # linearized tokens / step time
    mfu: float | None = None  # FLOPs of the unique tokens / step time / peak
    peak_mem_gib: float | None = None
    loss: float | None = None
    speedup_vs_linearized: float | None = None
    ideal_speedup: float | None = None  # FLOP-weighted compression ratio
    fraction_of_ideal: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    model_calls: int | None = None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
) -> MethodResult:
    """Run ``warmup + repeats`` steps of ``make_runner().forward_backward(forest, loss)``.

    Out-of-memory is caught and reported as ``status="oom"`` so the other methods
    still run; any other exception is reported as ``status="error"``.
    """
    free_memory(device)
    result = MethodResult(method=name, status="ok")
    runner = None
    try:
        runner = make_runner()
        times, out = [], None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            out = runner.forward_backward(forest, loss)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
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
    except torch.OutOfMemoryError as e:
        result.status = "oom"
        result.error = str(e).splitlines()[0]
    except Exception as e:  # reported, so one broken method does not hide the others
        result.status = "error"
        result.error = f"{type(e).__name__}: {e}"
    finally:
        runner = None
        model.zero_grad(set_to_none=True)
        free_memory(device)
    return result
