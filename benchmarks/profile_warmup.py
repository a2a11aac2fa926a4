"""Where the first steps go: the first ``--steps`` (5) training steps of each
configuration in a fresh process, on a fresh forest each step (issue 11 item 3).

Every configuration runs in its own child process (a fresh Python, CUDA context,
Triton and torch.compile state), on the same forests (``seed .. seed + steps - 1``; by
default one agentic tree of ~64k unique tokens, the issue's case). Per step:

* wall time (device-synchronized) and the step's unique tokens and model calls;
* Triton: kernels compiled in this process (``knobs.runtime.jit_cache_hook`` /
  ``jit_post_compile_hook``: every in-memory cache miss, whether it loads from the disk
  cache or compiles) and their seconds, split into those compiled while autotuning and
  the rest; autotuning runs and their seconds (``TRITON_PRINT_AUTOTUNING=1``, parsed
  from its messages; they include compiling the candidates);
* torch.compile (dynamo + inductor, forward and backward graphs: FlexAttention for
  tree-mask, the decoder layers with ``--compile``), from
  ``torch._dynamo.utils.cumulative_time_spent_ns``;
* the rest of the step (running the model, host work);
* the allocator: new cudaMalloc calls (``num_device_alloc``), allocation retries (a
  retry frees the cache and calls cudaMalloc again: slow), peak allocated / reserved.

The kernels compiled after the first step are listed with their specialization (a
recompile for a new constexpr or integer-alignment value shows up there).

The Triton disk cache (``--triton-cache``): ``shared`` (default) gives all children one
fresh directory, so the first configuration starts cold and the next ones find its
kernels on disk (the first one is run again at the end, warm, with ``--rerun-first``);
``cold`` gives each child a fresh one; ``default`` leaves Triton's own (~/.triton).
torch.compile's inductor cache follows the same choice.

    python benchmarks/profile_warmup.py --out benchmarks/results               # H100: ~4 min
    python benchmarks/profile_warmup.py --model tiny --set target_unique_tokens=600 --steps 3   # CPU smoke run
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SET = ["num_trees=1", "target_unique_tokens=65536"]
AUTOTUNE_RE = re.compile(r"Triton autotuning for function (\S+?),\s*with key as (.*?),\s*finished after ([\d.]+)s", re.S)


# ----------------------------------------------------------------------------- child side
class _Tee(io.TextIOBase):
    """Writes through to ``stream`` and keeps a copy (Triton prints autotuning there)."""

    def __init__(self, stream) -> None:
        self.stream, self.buffer_text = stream, []

    def write(self, text: str) -> int:
        self.buffer_text.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def take(self) -> str:
        text, self.buffer_text = "".join(self.buffer_text), []
        return text


class _TritonCompiles:
    """Triton JIT compilations of this process, via its cache hooks."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._last: tuple[float, dict] | None = None
        self.available = False
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._before
            knobs.runtime.jit_post_compile_hook = self._after
            self.available = True
        except Exception:  # no Triton, or one without knobs (< 3.4): reported as unavailable
            pass

    @staticmethod
    def _in_autotune() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.endswith(os.path.join("runtime", "autotuner.py")):
                return True
            frame = frame.f_back
        return False

    def _before(self, **kw):
        fn = kw.get("fn")
        info = {"kernel": getattr(fn, "name", str(fn)), "specialization": str(kw.get("repr", ""))[:400],
                "in_autotune": self._in_autotune()}
        self._last = (time.perf_counter(), info)
        return False  # False: compile it (True would skip the compilation)

    def _after(self, **kw):
        t0, info = self._last  # compilations are synchronous and not nested
        self.events.append({**info, "seconds": time.perf_counter() - t0})
        return None

    def take(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def _dynamo_seconds() -> float:
    try:
        from torch._dynamo.utils import cumulative_time_spent_ns as spent
    except Exception:
        return 0.0
    return sum(spent.get(k, 0.0) for k in ("entire_frame_compile", "entire_backward_compile")) / 1e9


def _allocator(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {"cuda_mallocs": s.get("num_device_alloc", 0), "alloc_retries": s.get("num_alloc_retries", 0)}


def child(args) -> int:
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    t_start = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    from dtree.baselines import make_method
    from dtree.bench.configs import parse_assignments, parse_configs
    from dtree.losses import ppo_clip
    from dtree.models import adapt, compile_layers
    from dtree.presets import build_model
    from dtree.workloads import make_workload

    compiles = _TritonCompiles()
    t_import = time.perf_counter() - t_start
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(args.model, dtype=dtype, device=device)
    if args.compile:
        compile_layers(model)
    spec = adapt(model).dtree_spec()
    t_model = time.perf_counter() - t0
    (config,) = parse_configs(args.config)
    overrides = parse_assignments(args.set, "--set")
    forests = [make_workload(args.workload, seed=args.seed + i, vocab_size=spec.vocab_size, **overrides)
               for i in range(args.steps)]
    loss = ppo_clip()
    t0 = time.perf_counter()
    runner = make_method(config.method, model, **config.options)
    t_runner = time.perf_counter() - t0
    tee.take()
    compiles.take()
    steps = []
    for i, forest in enumerate(forests):
        model.zero_grad(set_to_none=True)
        before_alloc, before_dynamo = _allocator(device), _dynamo_seconds()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = runner.forward_backward(forest, loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        events = compiles.take()
        tunes = [{"kernel": k, "key": key.strip(), "seconds": float(s)} for k, key, s in AUTOTUNE_RE.findall(tee.take())]
        after_alloc = _allocator(device)
        step = {
            "step": i + 1,
            "unique_tokens": forest.num_unique_tokens,
            "wall_s": wall,
            "model_calls": out.num_model_calls,
            "metrics": dict(out.metrics or {}),
            "triton_compiles": len(events),
            "triton_compile_s": sum(e["seconds"] for e in events),
            "triton_compile_outside_autotune_s": sum(e["seconds"] for e in events if not e["in_autotune"]),
            "autotune_runs": len(tunes),
            "autotune_s": sum(t["seconds"] for t in tunes),
            "torch_compile_s": _dynamo_seconds() - before_dynamo,
            "compiled_kernels": events if i > 0 else [{"kernel": e["kernel"], "in_autotune": e["in_autotune"]}
                                                       for e in events],
            "autotuned": tunes,
        }
        step["rest_s"] = wall - step["autotune_s"] - step["triton_compile_outside_autotune_s"] - step["torch_compile_s"]
        step.update({k: after_alloc[k] - before_alloc.get(k, 0) for k in after_alloc})
        if device.type == "cuda":
            step["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            step["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        steps.append(step)
        print(f"  {config.label} step {i + 1}: {wall:.2f} s (autotune {step['autotune_s']:.1f} s in "
              f"{len(tunes)} runs, triton compiles {len(events)}: {step['triton_compile_s']:.1f} s, torch.compile "
              f"{step['torch_compile_s']:.1f} s, rest {step['rest_s']:.2f} s), {out.num_model_calls} calls", flush=True)
    result = {
        "config": config.label, "method": config.method, "options": config.options,
        "import_s": t_import, "model_build_s": t_model, "runner_s": t_runner,
        "triton_hooks": compiles.available, "steps": steps,
    }
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    return 0


# ----------------------------------------------------------------------------- parent side
def _markdown(report: dict) -> str:
    env = report["env"]
    lines = [
        f"# Warm-up: the first {report['steps']} steps in a fresh process ({report['model']} on {env['device']})",
        "",
        f"- torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, transformers {env['transformers']}",
        f"- workload `{report['workload']}` {report['set']}, seeds {report['seed']}..{report['seed'] + report['steps'] - 1}"
        f" (a fresh forest each step); {'compiled' if report['compile'] else 'eager'} decoder layers",
        f"- Triton disk cache: {report['triton_cache']}; each configuration in its own process",
        "- autotune: seconds in Triton's autotuner (compiling and timing candidates); compile (outside autotune): "
        "Triton kernels compiled or loaded from disk outside it; torch.compile: dynamo + inductor (forward and "
        "backward); rest: the step minus those",
    ]
    for run in report["runs"]:
        lines += ["", f"## `{run['config']}`" + (f" ({run['label']})" if run.get("label") else "")]
        if run.get("error"):
            lines += ["", f"failed: {run['error']}"]
            continue
        lines += ["", f"process: imports {run['import_s']:.1f} s, model build {run['model_build_s']:.1f} s", "",
                  "| step | unique tokens | wall (s) | autotune (s, runs) | Triton compiles (n, s; outside autotune s) | "
                  "torch.compile (s) | rest (s) | calls | cudaMalloc | alloc retries | peak alloc / reserved (GiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in run["steps"]:
            mem = (f"{s['peak_allocated_gib']:.1f} / {s['peak_reserved_gib']:.1f}" if "peak_allocated_gib" in s else "-")
            lines.append(
                f"| {s['step']} | {s['unique_tokens']:,} | {s['wall_s']:.2f} | {s['autotune_s']:.1f} ({s['autotune_runs']}) "
                f"| {s['triton_compiles']}, {s['triton_compile_s']:.1f}; {s['triton_compile_outside_autotune_s']:.1f} "
                f"| {s['torch_compile_s']:.1f} | {s['rest_s']:.2f} | {s['model_calls']} | {s.get('cuda_mallocs', '-')} "
                f"| {s.get('alloc_retries', '-')} | {mem} |")
        later = [(s["step"], k) for s in run["steps"][1:] for k in s["compiled_kernels"]]
        if later:
            lines += ["", "Kernels compiled after step 1:", ""]
            lines += [f"- step {st}: `{k['kernel']}` {k['seconds']:.2f} s"
                      + (" (autotuning)" if k["in_autotune"] else "") + f": `{k['specialization'][:200]}`"
                      for st, k in later[:30]]
            if len(later) > 30:
                lines.append(f"- ... {len(later) - 30} more")
        tunes = [(s["step"], t) for s in run["steps"] for t in s["autotuned"]]
        if tunes:
            lines += ["", "Autotuning runs: " + "; ".join(f"step {st} `{t['kernel']}` key {t['key']} {t['seconds']:.1f} s"
                                                        for st, t in tunes)]
        group_tokens = [s["metrics"].get("group_tokens") for s in run["steps"] if "group_tokens" in s["metrics"]]
        if group_tokens:
            lines += ["", f"dtree group_tokens per step: {group_tokens}"]
    return "\n".join(lines) + "\n"


def parent(args) -> int:
    import torch

    sys.path.insert(0, ROOT)
    from dtree.bench.configs import parse_configs
    from dtree.bench.measure import device_name
    from dtree.bench.report import environment, write_profile_reports

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = args.model or ("qwen2.5-1.5b" if device.type == "cuda" else "tiny")
    configs = [c.label for c in parse_configs(args.configs)]
    plan = [(c, "") for c in configs]
    if args.rerun_first and args.triton_cache != "cold":
        plan.append((configs[0], "again, warm disk cache"))
    sets = args.set or DEFAULT_SET
    work = tempfile.mkdtemp(prefix="dtree_warmup_")
    shared = {"TRITON_CACHE_DIR": os.path.join(work, "triton"), "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor")}
    print(f"warm-up profile: {model} on {device_name(device)}; {plan}", flush=True)
    runs = []
    start = time.monotonic()
    for k, (config, label) in enumerate(plan):
        env = dict(os.environ, TRITON_PRINT_AUTOTUNING="1", PYTHONUNBUFFERED="1")
        if "expandable_segments" not in env.get("PYTORCH_CUDA_ALLOC_CONF", ""):  # as dtree bench runs
            env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [env.get("PYTORCH_CUDA_ALLOC_CONF"),
                                                                    "expandable_segments:True"]))
        if args.triton_cache == "shared":
            env.update(shared)
        elif args.triton_cache == "cold":
            env.update({n: os.path.join(work, f"{n.lower()}_{k}") for n in shared})
        result_path = os.path.join(work, f"result_{k}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", config, "--model", model,
               "--workload", args.workload, "--steps", str(args.steps), "--seed", str(args.seed),
               "--result", result_path] + [a for s in sets for a in ("--set", s)]
        cmd += ["--device", args.device] if args.device else []
        cmd += ["--compile"] if args.compile else []
        remaining = args.time_budget - (time.monotonic() - start)
        if remaining <= 10:
            runs.append({"config": config, "label": label, "error": "skipped: time budget spent"})
            continue
        print(f"--- {config} {label}", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=min(args.child_timeout, remaining), cwd=ROOT)
            if proc.returncode != 0 or not os.path.exists(result_path):
                runs.append({"config": config, "label": label, "error": f"child exited with {proc.returncode}"})
                continue
        except subprocess.TimeoutExpired:
            runs.append({"config": config, "label": label, "error": f"timed out after {min(args.child_timeout, remaining):.0f} s"})
            continue
        with open(result_path, encoding="utf-8") as f:
            runs.append({**json.load(f), "label": label})
    report = {"env": environment(device), "model": model, "workload": args.workload, "set": sets, "seed": args.seed,
              "steps": args.steps, "compile": args.compile, "triton_cache": args.triton_cache, "runs": runs}
    text = _markdown(report)
    print(text)
    if args.out:
        stem = write_profile_reports(report, text, args.out, "warmup", model)
        print(f"reports: {stem}.md, .json")
    return 0 if any("steps" in r for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="dtree,dtree:low,tree-mask:split16k", help="dtree bench --configs grammar")
    p.add_argument("--model", default=None, help="default: qwen2.5-1.5b on GPU, tiny on CPU")
    p.add_argument("--device", default=None)
    p.add_argument("--workload", default="agentic")
    p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help=f"workload parameter (repeatable; default {' '.join(DEFAULT_SET)})")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the decoder layers")
    p.add_argument("--triton-cache", choices=("shared", "cold", "default"), default="shared")
    p.add_argument("--rerun-first", action=argparse.BooleanOptionalAction, default=True,
                   help="run the first configuration again at the end, with the disk cache the others filled")
    p.add_argument("--child-timeout", type=float, default=240.0, help="seconds per configuration's process")
    p.add_argument("--time-budget", type=float, default=540.0, help="seconds for all processes")
    p.add_argument("--out", default=None)
    # internal: one configuration in this process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.set = args.set or []
        return child(args)
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
