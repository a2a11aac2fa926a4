"""Where a step's host time goes, sampled (py-spy) rather than traced (cProfile).

cProfile charges every Python call a fixed cost and times with the wall clock, so code made
of many small calls (module calls, argument binding) looks several times dearer than it is,
and a launch that blocks on a full CUDA queue charges whatever runs. A sampling profiler
reads the stacks ~500 times a second and leaves the step's speed alone. This script has two
parts:

* ``run``: the steps, under ``py-spy record --format raw`` (collapsed stacks), in a function
  named :data:`STEADY` after three warm-up steps, so that only steady steps are counted;
* ``report``: the collapsed stacks as Markdown: the calling thread (it runs the plan
  and, here, the backward too), milliseconds per step of each phase (plan, forward, loss,
  backward, finish) and the functions with the most own and inclusive time in the steps.

    py-spy record -r 500 -f raw -o /tmp/stacks.txt -- python benchmarks/host_sampling.py run --steps 40
    python benchmarks/host_sampling.py report /tmp/stacks.txt --steps 40 --rate 500

``benchmarks/host_sampling_gpu.sh`` does both on the GPU machine (py-spy from a carried wheel).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.host_profile import add_setup_arguments, script_setup  # noqa: E402

STEADY = "steady_steps"  # the function whose samples count
# a frame that starts a phase of the step (the innermost one on a stack wins)
PHASES = tuple((name, re.compile(rf"(^|\.)({fns}) \(")) for name, fns in (
    ("plan", "make_plan"),
    ("forward", "dtree_hidden_states"),
    ("loss", "_finish_group|token_logprobs"),
    ("backward", "_engine_run_backward"),
    ("finish", "TokenStep.finish"),
))


def steady_steps(runtime, forests, loss, model, device, host_timed_step) -> list[float]:
    """The steps the report counts (its name is what the report looks for), their backward
    on this thread so that its samples fall under this frame too."""
    import torch

    with torch.autograd.set_multithreading_enabled(False):
        return [host_timed_step(runtime, f, loss, model, device)["wall"] for f in forests]


def run(args) -> int:
    import torch

    from dtree.bench.measure import host_timed_step

    model, device, rt, loss, forests, _, _ = script_setup(args, args.steps + 3)  # three warm-up steps run
    t0 = time.perf_counter()
    walls = steady_steps(rt, forests[3:], loss, model, device, host_timed_step)
    print(f"{len(walls)} steady steps in {time.perf_counter() - t0:.2f} s, median "
          f"{sorted(walls)[len(walls) // 2]:.4f} s; torch {torch.__version__}; plan "
          f"{rt.memory_plan.describe() if rt.memory_plan else '-'}", flush=True)
    return 0


def _frames(stack: str) -> list[str]:
    """py-spy's collapsed stack ``thread;frame;frame`` -> its frames, outermost first."""
    return stack.split(";")


def _short(frame: str) -> str:
    """``fn (path:line)`` with the path cut to the package."""
    m = re.match(r"^(.*) \((.*):(\d+)\)$", frame)
    if not m:
        return frame
    fn, path, _ = m.groups()
    for cut in ("site-packages/", "/dtree/", "benchmarks/"):
        if cut in path:
            path = path.split(cut, 1)[-1]
            break
    return f"{fn} ({path})"


def report(args) -> int:
    ms_per_sample = 1e3 / args.rate
    own, inclusive, phases = collections.Counter(), collections.Counter(), collections.Counter()
    unphased = collections.Counter()  # outside the named phases: the innermost dtree frame
    forward = collections.Counter()  # inclusive time inside the forward phase
    with open(args.stacks, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = _frames(stack)
            at = next((i for i, fr in enumerate(frames) if fr.startswith(STEADY + " ")), None)
            if at is None:  # warm-up, imports, other threads
                continue
            body, n = frames[at + 1:], int(count)
            phase = next((p for fr in reversed(body) for p, rx in PHASES if rx.search(fr)), "other")
            phases[phase] += n
            if phase == "other":
                unphased[next((_short(fr) for fr in reversed(body) if re.search(r"[(/]dtree/", fr)), "-")] += n
            if body:
                own[_short(body[-1])] += n
            for fr in set(body):
                inclusive[_short(fr)] += n
                if phase == "forward":
                    forward[_short(fr)] += n
    total = sum(phases.values())
    name = os.path.basename(args.stacks)
    lines = [f"# Sampled host time per step ({args.steps} steps, {args.rate:g} samples/s, `{name}`)",
             "", f"{total * ms_per_sample / args.steps:.1f} ms per step with a Python stack (the backward ran on the "
             "calling thread)", "", "| phase | ms per step |", "|---|---|"]
    lines += [f"| {p} | {c * ms_per_sample / args.steps:.2f} |" for p, c in phases.most_common()]
    lines += ["", "## Outside the named phases, by the innermost dtree function", "", "| function | ms per step |",
              "|---|---|"]
    lines += [f"| `{fn}` | {c * ms_per_sample / args.steps:.2f} |" for fn, c in unphased.most_common(args.top // 2)]
    for title, table in (("own time", own), ("inclusive time", inclusive),
                         ("inclusive time in the forward phase (decoder layers' host work, or waits on a full queue)",
                          forward)):
        lines += ["", f"## By {title}", "", "| function | ms per step |", "|---|---|"]
        lines += [f"| `{fn}` | {c * ms_per_sample / args.steps:.2f} |" for fn, c in table.most_common(args.top)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    r = sub.add_parser("run", help="the steps (run it under py-spy record -f raw)")
    add_setup_arguments(r)
    r.add_argument("--steps", type=int, default=40)
    s = sub.add_parser("report", help="py-spy's collapsed stacks as Markdown")
    s.add_argument("stacks")
    s.add_argument("--steps", type=int, required=True, help="the steady steps the run made")
    s.add_argument("--rate", type=float, required=True, help="py-spy's samples per second (-r)")
    s.add_argument("--top", type=int, default=40)
    s.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args()
    return run(args) if args.part == "run" else report(args)


if __name__ == "__main__":
    raise SystemExit(main())
