"""Hybrid models through dtree's state stack on one GPU: bf16 checks, then a benchmark
against linearized training. One run, at most about 8 minutes on an H100.

    python benchmarks/hybrid_gpu.py --out "$OUT"                  # on the GPU
    python benchmarks/hybrid_gpu.py --wheels wheels --out "$OUT"  # with fla-core/einops wheels on the path
    python benchmarks/hybrid_gpu.py --smoke --out /tmp/hybrid      # CPU, tiny models, < 1 minute (CI)

The recurrence backend is ``fla`` (flash-linear-attention) where it runs, else dtree's
``chunked`` torch form (fla-core 0.6 refuses Hopper with Triton < 3.7.1; ``--recurrence``
names one). The smoke run uses ``chunked``.

1. **Kernels** (``benchmarks/bench_linear_recurrence.py``). The backend against the
   float64 recurrence, a varlen call with initial states: outputs, final states and every
   gradient within the flash-attention rule (2x forward, 3x gradient error of the all-bf16
   torch recurrence, plus a floor): gated DeltaNet's delta rule and Mamba2's SSD
   (``--all-kernels``: also Kimi's and Mamba's per-key decays). And a GRPO-shaped call's
   recurrence timed packed (one varlen call for 16 answers that start from one prompt's
   state) against one call per answer.
2. **Models.** bf16 Qwen3.5-shaped (gated DeltaNet, gated attention 3:1) and Nemotron-H-shaped
   (Mamba2, MLP, attention) models trained by dtree on a branching forest (default, node by
   node, recompute) against HF on each path: the loss within 2x and every gradient within 3x
   of the bf16 HF model's error against float32, plus a floor. transformers' modeling modules
   are imported before the wheels are on the path, so HF runs its torch recurrences (in
   float32 math: its bf16 model's error comes from the bf16 layers around them). For the
   worst gradient the report also gives the bf16 HF error with the paths in reverse order
   (a second sample of the baseline) and the error of the float32 gradient merely rounded
   to bf16 (the resolution of a bf16 ``param.grad``): a per-head gradient such as gated
   DeltaNet's ``A_log`` has a few elements, each a sum over every token, so its bound is
   one noisy sample (on CPU, dtree's ratio to it moves between 0.56 and 0.81 across layouts
   that agree to float32 rounding).
3. **Benchmark** (``benchmarks/hybrid_benchmark.py``). A Qwen3.5-shaped ~2B hybrid (random
   bf16 weights), agentic (one tool-use tree) and grpo (prompt 2048 + 8 x 512, two groups):
   dtree against linearized training (packed varlen, the same layer and recurrence kernels):
   step time, tokens/s, MFU (the FLOP count is in that module), peak memory, speedup and the
   ideal speedup. Mask-based training cannot express a recurrent state: not applicable.

Reports: ``$OUT/hybrid_gpu.md`` and ``$OUT/hybrid_gpu.json``; a summary is printed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent


def load_wheels(folder: str | None) -> list[dict]:
    """Unpack every wheel in ``folder`` (pure-Python: fla-core, einops) into a temporary
    directory at the front of ``sys.path``; returns their names and sizes."""
    if not folder or not Path(folder).is_dir():
        return []
    target = Path(tempfile.mkdtemp(prefix="dtree_wheels_"))
    found = []
    for wheel in sorted(Path(folder).glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
        found.append({"wheel": wheel.name, "MB": round(wheel.stat().st_size / 2**20, 2)})
    sys.path.insert(0, str(target))
    return found


def import_hf_references() -> None:
    """Import transformers' modeling modules now, so their recurrences bind the torch
    paths (transformers swaps in fla's kernels when fla is importable at import time)."""
    import transformers.models.nemotron_h.modeling_nemotron_h  # noqa: F401
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401


# ---------------------------------------------------------------------------- models
_QWEN35 = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "vocab_size")
_QWEN35_SIZES = {"2b": (2048, 24, 6144, 16, 4, 256, 16, 32, 128, 248320),
                 "check": (512, 4, 1536, 8, 2, 64, 4, 8, 64, 4096), "tiny": (64, 4, 128, 4, 2, 16, 2, 4, 8, 256)}
_NEMOTRON = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size", "vocab_size")
_NEMOTRON_SIZES = {"check": (512, 1536, 8, 2, 64, 16, 32, 64, 2, 128, 4096),
                   "tiny": (64, 128, 4, 2, 16, 4, 16, 8, 2, 16, 256)}


def qwen35_config(size: str):
    """Qwen3.5's text architecture (3 gated-DeltaNet layers per gated-attention layer,
    grouped value heads): ``2b`` (~2.2B params, tied 248k vocab), ``check`` (small) or ``tiny``."""
    from transformers import AutoConfig

    dims = dict(zip(_QWEN35, _QWEN35_SIZES[size]))
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(dims["num_hidden_layers"])]
    return AutoConfig.for_model(
        "qwen3_5_text", layer_types=types, tie_word_embeddings=True, max_position_embeddings=65536,
        attention_dropout=0.0, linear_value_head_dim=dims["linear_key_head_dim"], **dims,
    )


def nemotron_config(size: str):
    """Nemotron-H's architecture (Mamba2 layers, squared-ReLU MLP layers, attention): ``check`` or ``tiny``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "nemotron_h", num_hidden_layers=4, hybrid_override_pattern="M-M*", tie_word_embeddings=False,
        max_position_embeddings=65536, attention_dropout=0.0, **dict(zip(_NEMOTRON, _NEMOTRON_SIZES[size])),
    )


def build(config, device, dtype=torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config.use_cache = False
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


# ---------------------------------------------------------------------------- 2. models
def branching_sequences(vocab: int, scale: int, seed: int = 0) -> list[list[int]]:
    """A forest with branches at several depths, a 3-token node (shorter than the
    convolution windows), a prefix of another path and a second tree; ``scale``
    multiplies the lengths (segments cross fla's 64-token chunks at odd offsets)."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(3, vocab, max(1, n * scale // 10)).tolist()

    prompt, mid, short, other = tokens(200), tokens(70), tokens(3), tokens(90)
    return [prompt + mid + short + tokens(60), prompt + mid + short + tokens(45), prompt + mid + other,
            prompt + tokens(130), prompt + mid, tokens(150) + tokens(40)]


def per_path(model, seqs: list[list[int]]) -> tuple[float, dict[str, torch.Tensor]]:
    """HF on each sequence alone: token-mean NLL over every prediction, and every
    parameter's gradient (float32)."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    count = sum(len(s) - 1 for s in seqs)
    total = 0.0
    for s in seqs:
        x = torch.tensor([s], device=device)
        logits = model(input_ids=x).logits[0, :-1].float()
        nll = -torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).sum() / count
        nll.backward()
        total += nll.item()
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_model(name: str, config, device, seqs, settings: dict) -> list[dict]:
    """dtree in bf16 against HF per path: the loss within 2x, every gradient within 3x of
    the bf16 HF model's error against the float32 one, plus a floor."""
    import dtree

    base = build(config, device)
    loss_exact, grads_exact = per_path(copy.deepcopy(base), seqs)
    loss_bf16, grads_bf16 = per_path(copy.deepcopy(base).to(torch.bfloat16), seqs)
    # the same bf16 HF training with the paths in reverse order: a second sample of the
    # baseline's error (reported beside the worst gradient, not used in the bound)
    grads_bf16_reordered = per_path(copy.deepcopy(base).to(torch.bfloat16), seqs[::-1])[1]
    forest = dtree.Forest.from_sequences(seqs)
    rows = []
    for label, kw in settings.items():
        model = copy.deepcopy(base).to(torch.bfloat16)
        rt = dtree.TreeRuntime(model, **kw)
        t0 = time.perf_counter()
        out = rt.forward_backward(forest, dtree.losses.nll())
        seconds = time.perf_counter() - t0
        loss_ok = abs(out.loss - loss_exact) <= 2 * abs(loss_bf16 - loss_exact) + 1e-3 * max(1.0, abs(loss_exact))
        worst, worst_ratio, bad, detail = None, 0.0, [], {}
        for pname, p in model.named_parameters():
            exact = grads_exact[pname]
            err = (p.grad.float() - exact).abs().max().item()
            base_err = (grads_bf16[pname] - exact).abs().max().item()
            floor = 1e-3 * max(1e-3, exact.abs().max().item())
            ratio = err / (3 * base_err + floor)
            if ratio > worst_ratio:
                worst, worst_ratio = pname, ratio
                rounding = (exact.to(torch.bfloat16).float() - exact).abs().max().item()
                reordered = (grads_bf16_reordered[pname] - exact).abs().max().item()
                detail = {"worst_err": err, "worst_hf_bf16_err": base_err, "worst_hf_bf16_err_reordered": reordered,
                          "worst_bf16_rounding": rounding, "worst_numel": exact.numel()}
            if ratio > 1:
                bad.append(pname)
        rows.append({
            "model": name, "setting": label, "options": kw, "recurrence": out.metrics["recurrence"],
            "attention": out.metrics["attention"],
            "loss": out.loss, "loss_fp32": loss_exact, "loss_bf16_hf": loss_bf16, "loss_ok": loss_ok,
            "worst_param": worst, "worst_ratio_to_bound": worst_ratio, "bad_params": bad, **detail,
            "ok": loss_ok and not bad, "seconds": seconds, "model_calls": out.num_model_calls,
        })
    return rows


# ---------------------------------------------------------------------------- report, main
def _fmt(x, spec=".3g"):
    return "" if x is None else format(x, spec)


def environment(device, wheels: list[dict]) -> dict:
    import transformers

    import dtree.bench.measure as measure

    env = {"device": measure.device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "wheels": wheels}
    for name in ("triton", "fla"):
        try:
            env[name] = getattr(__import__(name), "__version__", "?")
        except Exception as error:  # noqa: BLE001 (reported)
            env[name] = f"unavailable ({type(error).__name__})"
    return env


def _table(rows: list[dict], columns: str) -> list[str]:
    """Markdown of ``rows``: ``columns`` is ``"header:key:format, ..."`` (format ``ok``:
    PASS/FAIL); a row that raised shows its error instead."""
    cols = [c.strip().split(":") for c in columns.split(",")]

    def cell(r, key, spec):
        value = r.get(key)
        return "" if value is None else {True: "PASS", False: "FAIL"}[value] if spec == "ok" else format(value, spec)

    out = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["error"])] if r.get("error") and "ok" in r else [cell(r, key, spec) for _, key, spec in cols]
        out.append("| " + " | ".join(cells) + " |")
    return out


def report(results: dict) -> str:
    lines = ["# Hybrid models through dtree's state stack", ""]
    lines += [f"- {k}: {v}" for k, v in results["environment"].items()]
    lines += ["", f"## 1. Kernels ({results.get('backend')} vs the float64 recurrence; bound 2x/3x the all-bf16 "
              "torch one + floor)", ""]
    lines += _table(results.get("kernels", []), "kernel:kernel:, tensor:tensor:, error:err:.3g, "
                    "bf16 torch error:bf16_torch_err:.3g, bound:bound:.3g, ok:ok:ok")
    pack = results.get("packing", {})
    lines += [results.get("kernels_note", ""), "", f"Packed siblings: {pack}", "",
              "## 2. Models (bf16 dtree vs HF per path; bound 2x loss / 3x "
              "gradient error of HF bf16 vs fp32 + floor)", ""]
    lines += _table(results.get("models", []), "model:model:, setting:setting:, recurrence:recurrence:, "
                    "loss:loss:.5f, loss fp32 HF:loss_fp32:.5f, worst gradient:worst_param:, "
                    "its error / bound:worst_ratio_to_bound:.2f, its error:worst_err:.3g, "
                    "HF bf16 error:worst_hf_bf16_err:.3g, HF bf16 paths reversed:worst_hf_bf16_err_reordered:.3g, "
                    "fp32 grad rounded to bf16:worst_bf16_rounding:.3g, "
                    "elements:worst_numel:, ok:ok:ok")
    bench = results.get("benchmark") or {}
    lines += ["", f"## 3. Benchmark: Qwen3.5-shaped hybrid, {bench.get('params', 0) / 1e9:.2f}B params, random", ""]
    lines += [f"Layers: {bench.get('layers')}. FLOPs per token {bench.get('flops_per_token', 0):.4g}, per attended "
              f"key {bench.get('flops_per_key', 0):.4g} (forward; x3 for training; benchmarks/hybrid_benchmark.py); "
              f"peak {bench.get('peak_tflops')} TFLOP/s.", ""]
    lines += _table(bench.get("runs", []), "workload:workload:, method:method:, recurrence:recurrence:, "
                    "unique tokens:unique_tokens:, linearized tokens:linearized_tokens:, step s:step_time_s:.3g, "
                    "tokens/s (unique):tokens_per_s:.0f, effective tokens/s:effective_tokens_per_s:.0f, "
                    "MFU:mfu:.1%, hardware MFU:hardware_mfu:.1%, peak GiB:peak_mem_gib:.1f, speedup:speedup:.2f, "
                    "ideal (FLOP compression):flop_compression:.2f, status:status:, error:error:")
    return "\n".join(lines + ["", f"Mask-based methods: {bench.get('mask_methods', '')}; dtree's tree-mask "
                               f"baseline: {bench.get('tree_mask', '')}", ""])


def _safely(run, what: dict) -> list[dict]:
    """``run()``'s rows, or one failed row saying what raised (the other parts still run)."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 (reported in the row)
        return [{**what, "ok": False, "error": f"{type(error).__name__}: {str(error)[:500]}"}]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_linear_recurrence import check_kernels, time_packing
    from benchmarks.hybrid_benchmark import benchmark

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/hybrid"))
    parser.add_argument("--wheels", default=os.environ.get("DTREE_WHEELS"), help="folder of wheels to put on sys.path")
    parser.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE") == "1")
    parser.add_argument("--all-kernels", action="store_true", help="also check the per-key decays (Kimi, Mamba)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no benchmark case starts after this")
    parser.add_argument("--recurrence", choices=("auto", "chunked", "fla", "reference"), default="auto",
                        help="the recurrence backend (auto: fla where it runs, else chunked)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    import_hf_references()
    wheels = load_wheels(args.wheels)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cuda":
        from dtree.bench.measure import use_expandable_segments

        use_expandable_segments()
    from dtree.ops.backends import Target
    from dtree.ops.linear_recurrence.fla_backend import fla_unavailable

    results: dict = {"environment": environment(device, wheels)}
    why = fla_unavailable(Target(device))
    backend = args.recurrence if args.recurrence != "auto" else "chunked" if why else "fla"
    results["backend"] = backend
    kinds = ["gdn", "ssd"] + (["kda", "gla"] if args.all_kernels else [])
    results["kernels"] = _safely(lambda: check_kernels(device, kinds, backend), {"kernel": "all", "tensor": "-"})
    results["kernels_note"] = f"backend: {backend}" + (f" (fla {why})" if why and backend != "fla" else "")
    results["packing"] = _safely(lambda: [time_packing(device, backend, args.smoke)], {"what": "packing"})[0]
    size, scale = ("tiny", 1) if args.smoke else ("check", 10)
    settings = {"default": dict(recurrence=backend), "calls": dict(group_tokens=0, chunk_size=64, recurrence=backend),
                "recompute": dict(mode="recompute", group_tokens=256, chunk_size=64, recurrence=backend)}
    results["models"] = []
    for name, config in (("qwen3.5", qwen35_config(size)), ("nemotron_h", nemotron_config(size))):
        seqs = branching_sequences(config.vocab_size, scale)
        results["models"] += _safely(lambda: check_model(name, config, device, seqs, settings), {"model": name})
    if backend != "reference" or args.smoke:  # the reference is token by token: far too slow for 2B
        dtype = torch.float32 if args.smoke else torch.bfloat16
        results["benchmark"] = benchmark(lambda: build(qwen35_config("tiny" if args.smoke else "2b"), device, dtype),
                                         device, args.smoke, start + args.budget_s, backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_gpu.md").write_text(report(results))
    (out / "hybrid_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    checks = results["kernels"] + results["models"]
    failed = [c for c in checks if not c["ok"]]
    print(f"hybrid_gpu: {len(checks) - len(failed)}/{len(checks)} checks pass ({results['kernels_note']}); "
          f"{time.perf_counter() - start:.0f} s; reports in {out}")
    for r in (results.get("benchmark") or {}).get("runs", []):
        print(f"  {r['workload']:8s} {r['method']:16s} {r.get('status')} step {_fmt(r.get('step_time_s'))} s, "
              f"MFU {_fmt(r.get('mfu'), '.1%')}, peak {_fmt(r.get('peak_mem_gib'), '.1f')} GiB, "
              f"speedup {_fmt(r.get('speedup'), '.2f')} (ideal {_fmt(r.get('flop_compression'), '.2f')})")
    for c in failed:
        print("  FAIL", {k: c[k] for k in c if k in ("kernel", "tensor", "model", "setting", "worst_param")})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    raise SystemExit(main())
