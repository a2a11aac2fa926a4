"""How far the host runs ahead of the GPU at each group of a steady dtree step.

``benchmarks/gpu_gaps.py`` finds where the GPU waited; this script says why. At every
group's forward, backward and loss it records the host's clock and a CUDA event. The GPU
reaches an event at or after the host recorded it; the difference is the queue's depth
there (how much queued work hid the host's next stretch). A depth near zero at a group's
start means the GPU had caught up with the host, and the host work that follows (the
first layer's mask tables, the attention interface) shows as idle GPU time.

It also runs one step under ``torch.cuda.set_sync_debug_mode("warn")`` and lists the
host-device synchronizations inside the step, each with the dtree frame that made it.

    python benchmarks/queue_depth.py --workload agentic64k             # H100
    python benchmarks/queue_depth.py --workload agentic64k --opt memory=14.5
    python benchmarks/queue_depth.py --smoke                           # CPU: plumbing only

Prints Markdown, also written to ``$OUT/queue_depth_<workload><_tag>.md`` when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import types
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402
from dtree.bench.measure import allocator_counts, counter_deltas, emit_report, sync_device  # noqa: E402
from dtree.engine import walk as walk_module  # noqa: E402


class _Marks:
    """(label, host seconds, CUDA event or None) per mark, in order."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.rows: list[tuple[str, float, object]] = []

    def mark(self, label: str) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.rows.append((label, time.perf_counter(), event))


def _instrumented(marks: _Marks):
    """Patches of TreeWalk.hidden and the walk's group finish that mark each group's start
    and end; returns a function that undoes them."""
    walk_cls, finish = walk_module.TreeWalk, walk_module._finish_group
    hidden = walk_cls.hidden

    def marked_hidden(self, g, push, checkpoint=0):
        kind = "forward" if torch.is_grad_enabled() else "forward (no grad)"
        marks.mark(f"{kind} g{g} ({self.sched.groups[g].num_tokens} tok)")
        out = hidden(self, g, push, checkpoint)
        marks.mark(f"  end g{g}")
        return out

    def marked_finish(state, total):
        marks.mark("  backward")
        out = finish(state, total)
        marks.mark("  backward queued")
        return out

    walk_cls.hidden = marked_hidden
    walk_module._finish_group = marked_finish

    def undo() -> None:
        walk_cls.hidden = hidden
        walk_module._finish_group = finish

    return undo


def _backward_marks(marks: _Marks):
    """Patches marking, inside each call's backward, the LM head's part and the decoder's
    (:class:`dtree.engine.head_first.HeadSplit`), the fused head's backward and its matmuls and
    dL/dlogits launches (the head's forward's too), and every
    checkpointed layer's backward (its re-run and its graph's backward, on the autograd
    thread); returns a function that undoes them."""
    from dtree.engine.head_first import HeadSplit
    from dtree.models.layer_recompute import _LayerRecompute
    from dtree.ops.logprobs import fused_head
    from dtree.ops.logprobs.fused_head import _FusedLogprobs

    split_backward, layer_backward, head_backward = HeadSplit.backward, _LayerRecompute.backward, _FusedLogprobs.backward
    layers = [0]

    def marked_split(self, loss):
        marks.mark("    head+decoder backward")
        out = split_backward(self, loss)
        marks.mark("    decoder backward queued")
        return out

    def marked_layer(ctx, *grads):
        layers[0] += 1
        marks.mark(f"      layer backward #{layers[0]}")
        return layer_backward(ctx, *grads)

    def marked_head(ctx, *grads):
        marks.mark("      fused head backward")
        out = head_backward(ctx, *grads)
        marks.mark("      fused head backward queued")
        return out

    HeadSplit.backward = marked_split
    _LayerRecompute.backward = staticmethod(marked_layer)
    _FusedLogprobs.backward = staticmethod(marked_head)
    parts = {name: getattr(fused_head, name) for name in ("_logits_into", "_dlogits_triton", "_accumulate_mm")}

    def marked_part(name, fn):
        def run(*args, **kwargs):
            marks.mark(f"        {name}")
            return fn(*args, **kwargs)
        return run

    for name, fn in parts.items():
        setattr(fused_head, name, marked_part(name, fn))

    def undo() -> None:
        HeadSplit.backward = split_backward
        _LayerRecompute.backward = staticmethod(layer_backward)
        _FusedLogprobs.backward = staticmethod(head_backward)
        for name, fn in parts.items():
            setattr(fused_head, name, fn)

    return undo


def _layer_marks(model, marks: _Marks, every: int):
    """Forward pre-hooks marking every ``every``-th decoder layer; returns their handles."""
    from dtree.models.layer_list import find_decoder_layers

    handles = []
    for i, layer in enumerate(find_decoder_layers(model) or []):
        if i % every == 0:
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: marks.mark(f"    layer {i}")))
    return handles


COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def step_counts(device) -> dict:
    """The allocator's :data:`COUNTERS` on ``device`` and the pinned host allocator's allocations and frees."""
    counts = allocator_counts(device, {k: k for k in COUNTERS})
    host = getattr(torch.cuda, "host_memory_stats", None)
    if device.type == "cuda" and host is not None:
        h = host()
        counts.update({f"host {k}": h.get(k, 0) for k in ("num_host_alloc", "num_host_free")})
    return counts


def compiled_variants() -> dict[str, int]:
    """Compiled kernel variants held now, per kernel: Triton's JIT caches and every
    function's ``compile_cache`` dict (flash-attn-4's interface keeps its CuTe kernels in
    those). A variant first used inside a step is compiled or loaded there, and loading a
    module can wait for the device to drain."""
    import gc

    counts: dict[str, int] = {}
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        JITFunction = None
    for obj in gc.get_objects():
        kind = type(obj)
        if JITFunction is not None and issubclass(kind, JITFunction):
            n = sum(len(c[0]) for c in getattr(obj, "device_caches", {}).values())
            if n:
                counts[f"triton {obj.fn.__name__}"] = counts.get(f"triton {obj.fn.__name__}", 0) + n
        elif kind is types.FunctionType and isinstance(obj.__dict__.get("compile_cache"), dict):
            name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__name__', '?')}"
            counts[name] = counts.get(name, 0) + len(obj.compile_cache)
    return counts


def depth_table(rt, model, forest, loss, device, layer_every: int = 0, backward_marks: bool = False) -> list[str]:
    marks = _Marks(device.type == "cuda")
    undo = _instrumented(marks)
    undo_backward = _backward_marks(marks) if backward_marks else (lambda: None)
    handles = _layer_marks(model, marks, layer_every) if layer_every else []
    before = step_counts(device)
    variants = compiled_variants()
    try:
        model.zero_grad(set_to_none=True)
        sync_device(device)
        marks.mark("step start")
        rt.forward_backward(forest, loss)
        marks.mark("step end (host)")
        sync_device(device)
    finally:
        undo()
        undo_backward()
        for h in handles:
            h.remove()
    after = step_counts(device)
    new = {k: n - variants.get(k, 0) for k, n in compiled_variants().items() if n != variants.get(k, 0)}
    label0, host0, event0 = marks.rows[0]
    lines = ["| mark | host ms | GPU ms | depth ms |", "|---|---|---|---|"]
    for label, host, event in marks.rows:
        h = (host - host0) * 1e3
        g = event0.elapsed_time(event) if event is not None else float("nan")
        lines.append(f"| {label} | {h:.1f} | {g:.1f} | {g - h:.1f} |")
    deltas = counter_deltas(before, after)
    return lines + ["", f"allocator counts in the step: {deltas}", "", f"kernel variants first used in the step: {new}"]


def sync_sites(rt, model, forest, loss, device) -> list[str]:
    """The synchronizations of one step, counted by the innermost dtree frame."""
    if device.type != "cuda":
        return ["(CPU: no synchronizations to find)"]
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/dtree/" in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
        sites[(str(message).split("\n")[0][:60], where or filename)] += 1

    model.zero_grad(set_to_none=True)
    sync_device(device)
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            rt.forward_backward(forest, loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    sync_device(device)
    lines = ["| count | warning | where (innermost dtree frames) |", "|---|---|---|"]
    lines += [f"| {n} | {msg} | {where} |" for (msg, where), n in sites.most_common(30)]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_setup_arguments(p, default_workload="agentic64k")
    p.add_argument("--steps", type=int, default=2, help="steps measured (fresh forests)")
    p.add_argument("--tag", default="")
    p.add_argument("--repeat", action="store_true", help="measure each forest twice (the second run has no first uses)")
    p.add_argument("--layer-every", type=int, default=0, help="also mark every N-th decoder layer's forward")
    p.add_argument("--backward-marks", action="store_true",
                   help="also mark the head's and the decoder's backward of each call and every checkpointed layer's")
    args = p.parse_args()
    model, device, rt, loss, forests, kind, options = script_setup(args, 3 + args.steps + 1)
    out = [f"# Queue depth at each group: {args.workload}, options {options or 'default'}", ""]
    measured = [f for f in forests[3:3 + args.steps] for _ in range(2 if args.repeat else 1)]
    for i, forest in enumerate(measured):
        out += [f"## step {i}", ""] + depth_table(rt, model, forest, loss, device, args.layer_every, args.backward_marks) + [""]
    out += ["## synchronizations in one step", ""] + sync_sites(rt, model, forests[-1], loss, device)
    emit_report("\n".join(out), f"queue_depth_{args.workload}{'_' + args.tag if args.tag else ''}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
