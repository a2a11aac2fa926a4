"""Part 3 of ``benchmarks/hybrid_gpu.py``: a Qwen3.5-shaped ~2B hybrid (random bf16
weights) trained by dtree against linearized training on the agentic and grpo
workloads: step time, tokens/s, MFU, peak memory, speedup and the ideal speedup.

Both methods run the same layer kernels (``dtree.bench.layers.apply_layers("auto")``:
Qwen3.5 has no lean or Liger layers, so its own) and the same recurrence kernels: the
linearized baseline packs its sequences into varlen calls whose segments each start
from zeros, through the same ``linear_recurrence`` op and backend as dtree (``fla``
where it runs, else ``chunked``). Tree-mask training cannot express a recurrent state:
it is reported as not applicable, with its refusal.

FLOPs (fwd + bwd = 3 x forward), counted on the forest's unique tokens:

* per token: 2 x every decoder and LM-head weight, plus per gated-DeltaNet layer
  ``6 H_v D_k D_v`` (the recurrent form's state decay-and-update and readout; the
  chunked form executes about 2.5x that, which is ~1.5% of the model's FLOPs here, so
  it is not credited);
* per attended key: ``4 H D`` per attention layer (scores and values).

``MFU`` is those unique-token FLOPs over the step time and the GPU's dense bf16 peak,
for both methods (useful work per second); ``hardware MFU`` counts what each method
executes (linearized: the FLOPs of every linearized token). The ideal speedup is the
forest's FLOP-weighted compression ratio.
"""

from __future__ import annotations

import time

import numpy as np
import torch

__all__ = ["hybrid_flops", "unique_training_flops", "benchmark", "workloads"]


def hybrid_flops(model) -> tuple[float, float]:
    """(forward FLOPs per token, forward FLOPs per attended key) of a Qwen3.5-shaped model
    (the module docstring's count)."""
    config = model.config
    linears = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    per_token = 2.0 * (linears + model.get_output_embeddings().weight.numel())
    types = config.layer_types
    recurrent = sum(t == "linear_attention" for t in types)
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    per_token += recurrent * 6.0 * state
    per_key = (len(types) - recurrent) * 4.0 * config.num_attention_heads * config.head_dim
    return per_token, per_key


def unique_training_flops(forest, per_token: float, per_key: float) -> float:
    """fwd + bwd (3x forward) FLOPs of the forest's unique tokens (a token at depth d attends to d + 1 keys)."""
    keys = float((forest.positions.astype(np.float64) + 1).sum())
    return 3.0 * (forest.num_unique_tokens * per_token + keys * per_key)


def workloads(vocab: int, smoke: bool) -> dict:
    from dtree.workloads import make_workload

    if smoke:
        return {"agentic": make_workload("agentic", tiny=True, vocab_size=vocab, num_trees=1),
                "grpo": make_workload("grpo", tiny=True, vocab_size=vocab, num_prompts=1)}
    return {
        "agentic": make_workload("agentic", num_trees=1, target_unique_tokens=16384, vocab_size=vocab),
        "grpo": make_workload("grpo", num_prompts=2, prompt_len=2048, group_size=8, answer_len=512, vocab_size=vocab),
    }


_KEEP = ("method", "status", "step_time_s", "tokens_per_s", "effective_tokens_per_s", "mfu", "peak_mem_gib",
         "peak_reserved_gib", "loss", "model_calls", "error", "note")


def _speedups(runs: list[dict]) -> None:
    """Each workload's dtree rows get linearized's step time (the plain run, else the
    checkpointed one) over their own, beside the ideal."""
    for r in runs:
        if r.get("method", "").startswith("dtree") and r.get("status") == "ok":
            lin = [x for x in runs if x["workload"] == r["workload"] and x["method"].startswith("linearized")
                   and x.get("status") == "ok"]
            if lin:
                r["speedup"] = lin[0]["step_time_s"] / r["step_time_s"]
                r["fraction_of_ideal"] = r["speedup"] / r["flop_compression"]


def benchmark(build_model, device, smoke: bool, deadline: float, recurrence: str = "auto") -> dict:
    """``build_model()`` -> the Qwen3.5-shaped model (on ``device``); dtree runs the
    ``recurrence`` backend (linearized its ``auto``: the same on CUDA); no case starts
    after ``deadline`` (``time.perf_counter()``)."""
    import dtree
    from dtree.baselines import LinearizedTrainer, TreeMaskTrainer
    from dtree.bench.layers import apply_layers
    from dtree.bench.measure import measure_method, peak_tflops

    model = build_model()
    layers = apply_layers(model, "auto", device)
    params = sum(p.numel() for p in model.parameters())
    per_token, per_key = hybrid_flops(model)
    peak = peak_tflops(device, next(model.parameters()).dtype)
    try:
        TreeMaskTrainer(model)
        mask = "ran (unexpected)"
    except ValueError as error:
        mask = f"not applicable: {error}"
    loss, runs = dtree.losses.nll(), []
    for wname, forest in workloads(model.config.vocab_size, smoke).items():
        flops = unique_training_flops(forest, per_token, per_key)
        compression = forest.flop_compression_ratio(per_token, per_key)
        methods = {
            "dtree": lambda: dtree.TreeRuntime(model, recurrence=recurrence),
            # only when the default plan ran out of memory
            "dtree memory=low": lambda: dtree.TreeRuntime(model, memory="low", recurrence=recurrence),
            "linearized": lambda: LinearizedTrainer(model),
            # only when 16k-token micro-batches ran out of memory: per-layer checkpointing
            "linearized+ckpt": lambda: LinearizedTrainer(model, checkpoint=True),
        }
        for method, make in methods.items():
            if method in ("dtree memory=low", "linearized+ckpt") and runs[-1]["status"] != "oom":
                continue
            row = {"workload": wname, "method": method, "unique_tokens": forest.num_unique_tokens,
                   "linearized_tokens": forest.num_linearized_tokens, "flop_compression": compression}
            if time.perf_counter() > deadline:
                runs.append({**row, "status": "skipped (time budget)"})
                continue
            r = measure_method(method, make, forest, loss, model, device=device, warmup=0 if smoke else 1,
                               repeats=1 if smoke else 2, unique_flops=flops, peak=peak).as_dict()
            row.update({k: r.get(k) for k in _KEEP})
            row["recurrence"] = (r.get("metrics") or {}).get("recurrence") or (
                LinearizedTrainer(model).recurrence if method.startswith("linearized") else None)
            if row["mfu"] is not None:
                row["hardware_mfu"] = row["mfu"] * (compression if method.startswith("linearized") else 1.0)
            runs.append(row)
            print(f"  {wname:8s} {method:16s} {row['status']} step {row.get('step_time_s')} s", flush=True)
    _speedups(runs)
    return {"params": params, "layers": layers, "flops_per_token": per_token, "flops_per_key": per_key,
            "peak_tflops": peak, "tree_mask": mask, "runs": runs,
            "mask_methods": "not applicable (AReaL tree mode, verl PrefixGrouper, Unsloth: a mask cannot carry a "
                            "recurrent state)"}
