"""Fit the cost model on this machine: time TreeRuntime steps, then non-negative least squares.

    dtree calibrate --model qwen2.5-0.5b --out cost_model.json

times ``TreeRuntime.forward_backward`` on forests of deliberately different shapes
(many short nodes: launch-bound; few long nodes: matmul-bound; a long shared
prefix: attention-bound; GRPO-like groups), so the four features vary
independently and every coefficient is identifiable, then fits
:class:`~dtree.distributed.cost_model.CostModel` and prints how well it explains
the measurements. The coefficients belong to the model shape, dtype, device and
:class:`~dtree.config.RuntimeConfig` (``mode``, ``group_tokens``, ...) they were
measured with; the saved JSON records them. It lives with the benchmark: it reuses
:mod:`dtree.workloads` and times real steps; its output feeds
:class:`dtree.distributed.CostModel`.

Forests: the built-in synthetic shapes (:func:`synthetic_forest`), any
:class:`~dtree.forest.forest.Forest` you pass, or workload names of :mod:`dtree.workloads`
(``grpo``, ``agentic``, ``search``) when that module is available.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Sequence

import numpy as np
import torch

from ..config import ATTENTIONS, RuntimeConfig
from ..distributed.cost_model import CostModel, FitReport
from ..distributed.features import forest_features
from ..engine.runtime import TreeRuntime
from ..forest.forest import Forest
from ..losses import nll
from .measure import sync_device

__all__ = ["calibrate", "synthetic_forest", "SYNTHETIC_KINDS", "add_calibrate_parser", "time_step"]

SYNTHETIC_KINDS = ("wide", "long", "deep", "grpo")


def _tree(rng: np.random.Generator, vocab: int, prompt: int, branching: int, levels: int, node_len: tuple[int, int]):
    """Root-to-leaf paths of one tree, and its token count (random ids rarely merge)."""
    paths = [rng.integers(vocab, size=max(1, prompt)).tolist()]
    count = len(paths[0])
    for _ in range(levels):
        grown = []
        for p in paths:
            for _ in range(branching):
                length = int(rng.integers(max(1, node_len[0]), max(1, node_len[1]) + 1))
                node = rng.integers(vocab, size=length).tolist()
                count += len(node)
                grown.append(p + node)
        paths = grown
    return paths, count


def synthetic_forest(kind: str, tokens: int, *, seed: int = 0, vocab_size: int = 32000) -> Forest:
    """A forest of about ``tokens`` unique tokens with a shape that stresses one term:

    * ``wide``: trees of 3-way branches, 2 to 4 levels, 4-24-token nodes (launches);
    * ``long``: few trees, 4 answers of ~1/10 of the budget each (matmul FLOPs);
    * ``deep``: one prefix of half the budget, then 2 x 2 branches (attention);
    * ``grpo``: 8 answers of 1/32 to 1/8 of a prompt-sized budget share (mixed).
    """
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic forest kind {kind!r}; choose from {SYNTHETIC_KINDS}")
    if tokens < 64:
        raise ValueError(f"tokens must be >= 64, got {tokens}")
    rng = np.random.default_rng([seed, SYNTHETIC_KINDS.index(kind), tokens])
    seqs: list[list[int]] = []
    made = 0
    while made < tokens:
        if kind == "wide":
            levels = 2 if tokens < 512 else 3 if tokens < 2048 else 4  # one tree stays within the budget
            paths, n = _tree(rng, vocab_size, 16, 3, levels, (4, 24))
        elif kind == "long":
            paths, n = _tree(rng, vocab_size, tokens // 16, 4, 1, (tokens // 14, tokens // 8))
        elif kind == "deep":
            paths, n = _tree(rng, vocab_size, tokens // 2, 2, 2, (tokens // 16, tokens // 10))
        else:
            paths, n = _tree(rng, vocab_size, tokens // 8, 8, 1, (tokens // 64, tokens // 16))
        seqs += paths
        made += n
    return Forest.from_sequences(seqs)


def time_step(runtime: TreeRuntime, forest: Forest, repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds of ``forward_backward`` (NLL, sum) on ``forest``; grads are cleared
    before every run so each run does the same work."""
    loss = nll("sum")
    times = []
    for i in range(warmup + repeats):
        runtime.module.zero_grad(set_to_none=True)
        sync_device(runtime.device)
        t0 = time.perf_counter()
        runtime.forward_backward(forest, loss)
        sync_device(runtime.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    runtime.module.zero_grad(set_to_none=True)
    return statistics.median(times)


def default_forests(budget_tokens: int, *, seed: int = 0, vocab_size: int = 32000) -> list[tuple[str, Forest]]:
    """Every synthetic kind at a quarter of and at the full budget."""
    out = []
    for kind in SYNTHETIC_KINDS:
        for frac in (0.25, 1.0):
            n = max(64, int(budget_tokens * frac))
            out.append((f"{kind}-{n}", synthetic_forest(kind, n, seed=seed, vocab_size=vocab_size)))
    return out


def _named_forests(workloads, budget_tokens: int, seed: int, vocab_size: int, tiny: bool) -> list[tuple[str, Forest]]:
    if workloads is None:
        return default_forests(budget_tokens, seed=seed, vocab_size=vocab_size)
    out = []
    for i, w in enumerate(workloads):
        if isinstance(w, Forest):
            out.append((f"forest{i}", w))
        elif w == "synthetic":
            out += default_forests(budget_tokens, seed=seed, vocab_size=vocab_size)
        elif isinstance(w, str):
            try:
                from ..workloads import make_workload
            except ImportError as e:  # optional: dtree.workloads may be absent
                raise ValueError(f"workload {w!r} needs dtree.workloads ({e}); pass forests or 'synthetic'") from e
            out.append((w, make_workload(w, seed=seed, vocab_size=vocab_size, tiny=tiny)))
        else:
            raise TypeError(f"a workload is a Forest, a workload name or 'synthetic', got {type(w).__name__}")
    return out


def calibrate(
    model: torch.nn.Module,
    config: RuntimeConfig | None = None,
    workloads: Sequence[Forest | str] | None = None,
    repeats: int = 3,
    out_path: str | None = None,
    *,
    warmup: int = 1,
    budget_tokens: int | None = None,
    seed: int = 0,
    tiny: bool = False,
    log: Callable[[str], None] | None = print,
    timer: Callable[[TreeRuntime, Forest, int, int], float] = time_step,
) -> tuple[CostModel, FitReport]:
    """Time ``model`` on forests of varied shapes, fit, print, and save the cost model.

    Args:
        model: a transformers causal LM or TreeModule, on the device to calibrate.
        config: the :class:`~dtree.config.RuntimeConfig` to calibrate (``mode``,
            ``group_tokens``, ``chunk_size``, ``attention``, ...): the fitted
            coefficients are only valid for these. Default ``RuntimeConfig()``.
        workloads: forests, ``dtree.workloads`` names, and/or ``"synthetic"``; default
            the synthetic shapes (:func:`default_forests`).
        repeats: timed runs per forest (the median is used), after ``warmup`` runs.
        out_path: where to save the JSON (``CostModel.save``); None: do not save.
        budget_tokens: unique tokens of the largest synthetic forest (default 8192 on
            CUDA, 512 on CPU).
        tiny: CPU-sized ``dtree.workloads`` shapes.
        log: printer for progress and the fit table (None: silent).
        timer: ``timer(runtime, forest, repeats, warmup) -> seconds`` of one step;
            :func:`time_step` (the median of timed ``forward_backward`` calls) by default.

    Returns:
        (fitted model, fit report).
    """
    log = log or (lambda _: None)
    config = config or RuntimeConfig()
    rt = TreeRuntime(model, config=config)
    if budget_tokens is None:
        budget_tokens = 8192 if rt.device.type == "cuda" else 512
    forests = _named_forests(workloads, budget_tokens, seed, rt.spec.vocab_size, tiny)
    if len(forests) < 2:
        raise ValueError("calibration needs at least 2 forests")
    rows, times = [], []
    for name, forest in forests:
        seconds = timer(rt, forest, repeats, warmup)
        rows.append(forest_features(forest))
        times.append(seconds)
        log(f"  {name:<16} {forest.num_nodes:>6} nodes {forest.num_unique_tokens:>8} tokens  {1e3 * seconds:9.2f} ms")
    meta = {
        "model": rt.spec.name, "num_layers": rt.spec.num_layers, "hidden_size": rt.spec.hidden_size,
        "dtype": str(rt.dtype).replace("torch.", ""), "device": _device_name(rt.device), "torch": torch.__version__,
        "runtime": config.as_dict(), "attention": rt.attention, "repeats": repeats,
    }
    cost_model, report = CostModel.fit(rows, times, meta=meta)
    log(_fit_table(forests, rows, times, cost_model))
    log(f"fit: {report.format()}")
    log(f"coefficients: {cost_model.format()}")
    if out_path:
        cost_model.save(out_path)
        log(f"saved {out_path}")
    return cost_model, report


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def _fit_table(forests, rows, times, cost_model: CostModel) -> str:
    lines = [
        f"{'forest':<16} {'nodes':>7} {'tokens':>9} {'attention':>12} {'measured ms':>12} {'predicted ms':>13} "
        f"{'error':>7}"
    ]
    for (name, _), x, t in zip(forests, rows, times):
        p = cost_model.cost(x)
        lines.append(
            f"{name:<16} {int(x.nodes):>7} {int(x.tokens):>9} {int(x.attention):>12} {1e3 * t:>12.2f} {1e3 * p:>13.2f} "
            f"{100 * (p - t) / t:>6.1f}%"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def _run(args: argparse.Namespace) -> int:
    from ..presets import model_from_args

    model = model_from_args(args)
    config = RuntimeConfig(mode=args.mode, group_tokens=args.group_tokens, chunk_size=args.chunk_size,
                           attention=args.attention)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()] if args.workloads else None
    print(f"calibrating {args.model} ({args.dtype}) on {args.device} with {config}")
    calibrate(model, config, workloads, args.repeats, args.out, warmup=args.warmup,
              budget_tokens=args.budget_tokens, seed=args.seed, tiny=args.tiny)
    return 0


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``calibrate`` to ``dtree``'s subcommands (``subparsers`` from
    ``parser.add_subparsers()``); sets ``func`` to the command, which returns an exit code."""
    from ..presets import add_model_arguments

    p = subparsers.add_parser(
        "calibrate", help="time tree-training steps on this device and fit the distributed cost model",
        description=__doc__.split("\n\n")[0],
    )
    add_model_arguments(p)
    g = p.add_argument_group("runtime (the coefficients are valid for these settings)")
    g.add_argument("--mode", default="retain", choices=["retain", "recompute"])
    g.add_argument("--group-tokens", type=int, default=8192)
    g.add_argument("--chunk-size", type=int, default=2048)
    g.add_argument("--attention", default="auto", choices=ATTENTIONS)
    g = p.add_argument_group("measurement")
    g.add_argument("--workloads", default=None,
                   help="comma-separated: synthetic, grpo, agentic, search (default: synthetic)")
    g.add_argument("--tiny", action="store_true", help="CPU-sized dtree.workloads shapes")
    g.add_argument("--budget-tokens", type=int, default=None,
                   help="unique tokens of the largest synthetic forest (default 8192 on cuda, 512 on cpu)")
    g.add_argument("--repeats", type=int, default=3, help="timed runs per forest; the median is used")
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--out", default="cost_model.json", help="where to write the fitted model (JSON)")
    p.set_defaults(func=_run)
    return p
