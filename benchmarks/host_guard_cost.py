"""What the host guard of ``param.grad`` costs (``grad_guard="host"``, :class:`dtree.engine.grad_guard.GradHostCopy`).

With every trainable parameter of the bench model holding a gradient (an accumulation loop's second
micro-batch), this times, on one GPU:

* pinning a host buffer of the gradients' size (the first time, and through torch's caching host
  allocator again), against the guard's kept buffer;
* the guard's host time to queue its copies and hooks, and the copies' own GPU time (GB/s);
* the same copies while the compute stream runs matmuls: the compute's slowdown (the copies share
  HBM bandwidth with it) and whether the copies finish behind it;
* ``commit``'s host time;
* with ``--step``, optimizer steps of 2 micro-batches on the 64k agentic tree under ``memory=14.5``
  (``forward_backward_micro_batches``, the second micro-batch host-guarded), alternating the guard
  as it is, the guard without its hooks (the compute stream waits for every copy at the start),
  the hooks without copies, and no guard: which part of the guard costs step time.

    python benchmarks/host_guard_cost.py            # H100 / H200
    python benchmarks/host_guard_cost.py --smoke    # CPU: plumbing only (the CPU guard clones)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import ClassVar

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree
from benchmarks.host_profile import SMOKE, WORKLOADS
from dtree.bench.measure import emit_report, script_model, sync_device
from dtree.bench.report import environment
from dtree.engine import grad_guard as guards
from dtree.engine.grad_guard import GradHostCopy
from dtree.losses import Normalization, ppo_clip
from dtree.models import adapt
from dtree.workloads import make_workload

GB = 1e9


def _matmuls(device: torch.device, seconds: float) -> callable:
    """A closure queueing about ``seconds`` of bf16 matmuls on the current stream."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(4):
        a @ a
    sync_device(device)
    per = (time.perf_counter() - t0) / 4
    n = max(1, round(seconds / per))

    def run() -> None:
        for _ in range(n):
            a @ a
    return run


class WaitAtStart(GradHostCopy):
    """The guard without hooks: the compute stream waits for every copy before the step's first kernel."""

    def _copy_to_host(self, indices):
        super()._copy_to_host(indices)
        for handle in self._hooks:
            handle.remove()
        for done in self._done:
            torch.cuda.current_stream().wait_event(done)


class HooksOnly(GradHostCopy):
    """The guard's hooks on an event recorded at once, without the copies (not a guard: timing only)."""

    def _copy_to_host(self, indices):
        done = torch.cuda.Event()
        done.record()
        compute = torch.cuda.current_stream()
        for i in indices:
            self._hooks.append(self.params[i].register_hook(self._wait_hook(len(self._hooks), done, compute)))
        self._done.append(done)


class Timed(GradHostCopy):
    """The guard, with timing events: when the copies end and when the first backward writes a
    gradient (from the step's start, on the GPU), and how long the compute stream stalls in the
    hooks' waits (summed); one line per host-guarded micro-batch in ``Timed.log``."""

    log: ClassVar[list[str]] = []

    def _copy_to_host(self, indices):
        self._t = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self._t[0].record()
        super()._copy_to_host(indices)
        self._t[1].record(self._sides[-1])
        self._stalls: list = []

    def _wait_hook(self, k, done, compute):
        wait = super()._wait_hook(k, done, compute)

        def timed_wait(grad):
            pair = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            pair[0].record(torch.cuda.current_stream())
            wait(grad)
            pair[1].record(torch.cuda.current_stream())
            self._stalls.append(pair)
        return timed_wait

    def commit(self) -> None:
        if self._sides:
            torch.cuda.synchronize()
            start, copied = self._t
            first = min(start.elapsed_time(a) for a, _ in self._stalls) if self._stalls else float("nan")
            stall = sum(a.elapsed_time(b) for a, b in self._stalls)
            Timed.log.append(f"copies end {start.elapsed_time(copied):.1f} ms, first write {first:.1f} ms, "
                             f"{len(self._stalls)} waits stall {stall:.1f} ms")
        super().commit()


def guard_variants(model, device, steps: int, smoke: bool) -> list[tuple[str, str]]:
    """(variant, mean seconds per optimizer step) over ``steps`` alternating optimizer steps."""
    kind, params = (SMOKE if smoke else WORKLOADS)["agentic64k"]
    vocab = adapt(model).dtree_spec().vocab_size
    batches = [[make_workload(kind, seed=2 * s + i, vocab_size=vocab, **params) for i in range(2)]
               for s in range(steps + 1)]
    loss = ppo_clip(clip_eps=0.2, reduction="token_mean")
    cap = 4 if smoke else 14.5
    variants = {"host guard": (GradHostCopy, "host"), "timed host guard": (Timed, "host"), "copies, no hooks": (WaitAtStart, "host"),
                "hooks, no copies": (HooksOnly, "host"), "in place": (GradHostCopy, False)}
    runtimes = {name: dtree.TreeRuntime(model, memory=cap, grad_guard=g) for name, (_, g) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    original = guards.GradHostCopy
    try:
        order = list(variants.items())
        for s, forests in enumerate(batches):  # the first to meet new forests (kernel compilations) rotates
            for name, (cls, _) in order[s % len(order):] + order[:s % len(order)]:
                guards.GradHostCopy = cls
                model.zero_grad(set_to_none=True)
                dt = timed(lambda rt=runtimes[name], fs=forests: rt.forward_backward_micro_batches(
                    fs, loss, normalization=Normalization.from_forests(fs, loss)), device)
                if s:
                    times[name].append(dt)
                print(f"{name} step {s}: {dt:.3f} s", flush=True)
    finally:
        guards.GradHostCopy = original
    rows = [(f"64k, 2 micro-batches, memory={cap}: {name}", f"{sum(t) / len(t):.3f} s per optimizer step")
            for name, t in times.items()]
    return rows + [(f"timed host guard, micro-batch {k}", line) for k, line in enumerate(Timed.log)]


def timed(fn, device) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    p.add_argument("--step", type=int, default=0, metavar="N", help="N timed optimizer steps per guard variant")
    args = p.parse_args()
    model, device = script_model(args.smoke)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.ones_like(q)
    nbytes = sum(q.numel() * q.element_size() for q in params)
    rows = [("gradients", f"{nbytes / GB:.2f} GB in {len(params)} tensors")]
    if device.type == "cuda":
        for label in ("pin a buffer (first)", "pin a buffer (caching allocator)"):
            t0 = time.perf_counter()
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            rows.append((label, f"{(time.perf_counter() - t0) * 1e3:.1f} ms"))
            del buf
    if device.type == "cuda":
        _matmuls(device, 0.01)  # cuBLAS's first call out of the calibration
    compute = _matmuls(device, 0.3) if device.type == "cuda" else (lambda: None)
    alone = timed(compute, device)
    for k in range(3):  # the first pins the guard's buffer
        sync_device(device)
        t0 = time.perf_counter()
        guard = GradHostCopy(params)
        queued = time.perf_counter() - t0
        for done in guard._done:
            done.synchronize()
        copies = time.perf_counter() - t0  # queued and done
        t1 = time.perf_counter()
        guard.commit()
        rows.append((f"guard {k}: queue / queued and copied / commit",
                     (f"{queued * 1e3:.1f} ms / {copies * 1e3:.1f} ms ({nbytes / GB / max(copies, 1e-9):.1f} GB/s) "
                      f"/ {(time.perf_counter() - t1) * 1e3:.2f} ms")))
    for k in range(2):
        sync_device(device)
        t0 = time.perf_counter()
        guard = GradHostCopy(params)
        compute()
        sync_device(device)
        both = time.perf_counter() - t0
        guard.commit()
        rows.append((f"guard {k} with {alone * 1e3:.0f} ms of matmuls",
                     f"{both * 1e3:.1f} ms (+{(both - alone) * 1e3:.1f} ms)"))
    for q in params:
        q.grad = None
    if args.step:
        rows += guard_variants(model, device, args.step, args.smoke or device.type != "cuda")
    env = environment(device)
    lines = [f"# The host guard's cost: {env.get('device', device.type)}", "",
             "- " + ", ".join(f"{k} {v}" for k, v in env.items()), "", "| what | measured |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    emit_report("\n".join(lines) + "\n", "host_guard_cost.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
