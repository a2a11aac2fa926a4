"""verl's own FSDP engine against the dtree engine (dtree.integrations.verl) on one GPU:
agreement of the gradients and step time / peak memory of one train_batch.

On the same batch, with verl's own ``ppo_loss`` (GRPO: vanilla clip, low_var_kl KL):

1. **Agreement** (the flash-attention rule): each bf16 engine's gradient against an fp32
   reference (verl's engine in fp32, SDPA, padded): dtree's error must be at most 3x
   verl's own bf16 error plus an absolute floor, over all parameters (global relative
   norm) and for the worst parameter.
2. **Speed and memory** of one ``train_batch`` (steady: mean of the timed steps after a
   warm-up), on a GRPO batch (8 prompts x 16 answers) and an agentic batch (multi-turn
   trajectories sharing long prefixes), for: dtree (fast path and two-pass); verl with
   its recommended settings (remove-padding, flash-attn when installed, dynamic batch
   size) with gradient checkpointing on and off; verl with PrefixGrouper, which verl
   0.9.1's engine path does not apply (reported as not run, with the reason).

Needs verl 0.9.1 and its dependencies with transformers 5.10.4 (verl pins < 5.11) and,
for verl's recommended settings, flash-attn. These cannot be carried to the lent H100
(no network there, 64 MiB of wheels): ``import verl`` imports Ray (a 76 MB wheel for
cp312), and verl's engine imports datasets -> pyarrow (53 MB) and pandas (12 MB). Run it
where ``pip install 'dtree[verl]'`` works::

    python benchmarks/verl_engine_h100.py --model qwen2.5-1.5b     # ~8 min on an H100
    SMOKE=1 python benchmarks/verl_engine_h100.py                  # CPU, tiny model, seconds

Writes ``verl_engine_<gpu>_<model>.md`` and ``.json`` to ``$OUT`` (or
``benchmarks/results/``) and prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout
sys.path.insert(0, os.path.join(ROOT, "tests"))  # verl's batch layout and the CPU platform (smoke mode)

SMOKE = os.environ.get("SMOKE") == "1"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny" if SMOKE else "qwen2.5-1.5b")
    p.add_argument("--steps", type=int, default=1 if SMOKE else 3, help="timed steps after one warm-up")
    p.add_argument("--max-token-len", type=int, default=16384, help="verl's max_token_len_per_gpu (dynamic bsz)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    return p.parse_args()


def check_environment() -> None:
    try:
        import verl  # noqa: F401
    except ImportError:
        sys.exit("needs verl 0.9.1: pip install 'dtree[verl]' (transformers < 5.11); see this script's docstring")


# ---------------------------------------------------------------------- batches in verl's layout
def forest_rows(forest, seed: int) -> tuple[list, list[int], dict]:
    """A workload forest as verl rows: the prompt is everything before the first loss
    token, the response the rest (tool tokens masked); advantages per row, old/ref
    log-probs filled later."""
    g = np.random.default_rng(seed)
    seqs, prompt_lens, masks, adv = [], [], [], []
    for s in range(forest.num_sequences):
        mask = forest.field("loss_mask", s)
        first = int(np.flatnonzero(mask)[0]) if mask.any() else len(mask) - 1
        seqs.append(forest.sequence(s).tolist())
        prompt_lens.append(max(1, first))
        masks.append(mask.tolist())
        adv.append([float(g.normal())] * len(mask))
    zeros = [[0.0] * len(m) for m in masks]
    return seqs, prompt_lens, dict(loss_mask=masks, advantages=adv, old_logprobs=zeros, ref_logprobs=zeros)


def make_batches(vocab: int) -> dict:
    from dtree.workloads import make_workload

    if SMOKE:
        grpo = make_workload("grpo", tiny=True, vocab_size=vocab, num_prompts=2, group_size=4)
        agentic = make_workload("agentic", tiny=True, vocab_size=vocab, num_trees=1)
    else:
        grpo = make_workload("grpo", vocab_size=vocab, num_prompts=8, group_size=16, prompt_len=1024, answer_len=512)
        agentic = make_workload("agentic", vocab_size=vocab, num_trees=1, trajectories=24)
    return {"grpo": forest_rows(grpo, 0), "agentic": forest_rows(agentic, 1)}


def verl_batch(rows, old, ref, temperature: float = 1.0):
    """The batch as verl's trainer hands it to update_actor (left_right_2_no_padding)."""
    import verl_cpu
    from verl_reference import response_batch

    seqs, prompt_lens, fields = rows
    fields = {**fields, "old_logprobs": old, "ref_logprobs": ref}
    batch = response_batch(seqs, prompt_lens, fields)
    return verl_cpu.actor_batch(batch, temperature, global_batch_size=len(seqs), calculate_entropy=False)


# ---------------------------------------------------------------------- engines
@dataclasses.dataclass(frozen=True)
class EngineSetting:
    name: str
    backend: str  # "dtree" or "verl"
    dtype: str = "bf16"
    remove_padding: bool = True
    flash: bool = True
    dynamic_bsz: bool = True
    checkpointing: bool = False
    fast_path: bool = True


SETTINGS = [
    EngineSetting("dtree (fast path)", "dtree"),
    EngineSetting("dtree (two-pass: verl's loss)", "dtree", fast_path=False),
    EngineSetting("verl: rmpad + flash + dyn-bsz, ckpt on", "verl", checkpointing=True),
    EngineSetting("verl: rmpad + flash + dyn-bsz, ckpt off", "verl"),
]
REFERENCE = EngineSetting("verl fp32 reference (SDPA, padded)", "verl", dtype="fp32", remove_padding=False,
                          flash=False, dynamic_bsz=False)
PREFIX_GROUPER = ("verl 0.9.1's FSDP engine never applies PrefixGrouper (use_prefix_grouper only changes the "
                  "trainer's group balancing; the legacy actor that patched attention is gone)")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        return torch.cuda.is_available()
    except ImportError:
        return False


def build_engine(setting: EngineSetting, path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    import dtree.integrations.verl  # noqa: F401  (registers "dtree")

    attn = "flash_attention_2" if setting.flash and flash_available() else "sdpa"
    model = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": attn},
                          enable_gradient_checkpointing=setting.checkpointing,
                          use_remove_padding=setting.remove_padding)
    mp = {"param_dtype": setting.dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=mp, use_torch_compile=False)
    optim = FSDPOptimizerConfig(lr=0.0, weight_decay=0.0, total_training_steps=1, clip_grad=1e9)
    configs = dict(model_config=model, engine_config=engine, optimizer_config=optim,
                   checkpoint_config=CheckpointConfig())
    if setting.backend == "dtree":
        eng = EngineRegistry.new("language_model", "dtree", **configs)
        eng.fast_path = setting.fast_path
    else:
        eng = transformer_impl.FSDPEngineWithLMHead(**configs)
    with skip_trl_patch(transformer_impl):
        eng.initialize()
    return eng, attn


@contextlib.contextmanager
def skip_trl_patch(transformer_impl):
    """verl 0.9.1's model patch imports TRL's AutoModelForCausalLMWithValueHead, gone from
    TRL 1.x: where such a TRL is installed, skip the patch (it swaps flash-attn's varlen
    function for its Ulysses version, an identity at sequence-parallel size 1)."""
    try:
        import trl
        broken = not (hasattr(trl, "AutoModelForCausalLMWithValueHead") or _has_experimental_ppo())
    except ImportError:
        broken = False
    if not broken:
        yield
        return
    patch = transformer_impl.apply_monkey_patch
    transformer_impl.apply_monkey_patch = lambda **kw: None
    try:
        yield
    finally:
        transformer_impl.apply_monkey_patch = patch


def _has_experimental_ppo() -> bool:
    try:
        import trl.experimental.ppo  # noqa: F401
        return True
    except ImportError:
        return False


# ---------------------------------------------------------------------- measuring
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_batch(engine, td, setting: EngineSetting, loss_function, max_token_len: int) -> float:
    """One verl train_batch (zero_grad, forward/backward, lr-0 step); seconds. Without
    dynamic batch size, one row per micro-batch (full [T, vocab] logits per row)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(td, use_dynamic_bsz=setting.dynamic_bsz, max_token_len_per_gpu=max_token_len,
                         micro_batch_size_per_gpu=1, use_remove_padding=setting.remove_padding)
    _sync()
    t0 = time.perf_counter()
    with engine.train_mode(zero_grad_on_exit=False):
        engine.train_batch(td, loss_function)
    _sync()
    return time.perf_counter() - t0


def host_grads(module) -> dict[str, torch.Tensor]:
    import verl_cpu

    return {n: g.float().cpu() for n, g in verl_cpu.full_grads(module).items() if g is not None}


def run_setting(setting, path, batches, loss_function, args, steps: int) -> tuple[dict, dict]:
    """Every workload through one engine, a warm-up step and ``steps`` timed ones:
    {workload: timing row}, {workload: gradients}."""
    rows, grads = {}, {}
    try:
        engine, attn = build_engine(setting, path)
    except Exception as e:  # an engine that cannot be built is reported, not fatal
        return {w: dict(setting=setting.name, error=f"{type(e).__name__}: {e}"[:300]) for w in batches}, {}
    for workload, td in batches.items():
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            times = [train_batch(engine, td.clone(), setting, loss_function, args.max_token_len)
                     for _ in range(1 + steps)]
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            rows[workload] = dict(setting=setting.name, attention=attn, seconds=float(np.mean(times[1:] or times)),
                                  first_seconds=times[0], peak_gib=peak)
            grads[workload] = host_grads(engine.module)
        except torch.OutOfMemoryError:
            rows[workload] = dict(setting=setting.name, attention=attn, error="out of memory")
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows, grads


def relative_errors(got: dict, want: dict) -> tuple[float, dict]:
    """(global relative error over all parameters, per-parameter relative errors)."""
    num = sum(float((got[n] - w).double().norm() ** 2) for n, w in want.items())
    den = sum(float(w.double().norm() ** 2) for w in want.values())
    per = {n: float((got[n] - w).norm() / w.norm().clamp(min=1e-30)) for n, w in want.items()}
    return (num / den) ** 0.5, per


FLOOR = 1e-3  # absolute floor of the rule, on relative errors


def agreement(reference: dict, dtree_grads: dict, verl_grads: dict) -> dict:
    """The flash-attention rule: dtree (bf16) at most 3x as far from the fp32 reference as
    verl's bf16 engine, plus FLOOR, globally and for every parameter."""
    d_glob, d_per = relative_errors(dtree_grads, reference)
    v_glob, v_per = relative_errors(verl_grads, reference)
    worst = max(d_per, key=lambda n: d_per[n] - 3 * v_per[n])
    ok = d_glob <= 3 * v_glob + FLOOR and all(d_per[n] <= 3 * v_per[n] + FLOOR for n in d_per)
    return dict(dtree_error=d_glob, verl_error=v_glob, worst_parameter=worst, worst_dtree=d_per[worst],
                worst_verl=v_per[worst], passed=bool(ok))


# ---------------------------------------------------------------------- the run
def old_and_ref_logprobs(engine, tds: dict) -> None:
    """verl's compute_log_prob (the fp32 reference engine) fills old/ref log-probs, with
    noise so the ratios and the KL are not trivially 1 and 0."""
    from verl.workers.utils.padding import no_padding_2_padding

    g = torch.Generator().manual_seed(0)
    for td in tds.values():
        with engine.eval_mode():
            lp = no_padding_2_padding(engine.infer_batch(td.clone())["model_output"]["log_probs"], td).float().cpu()
        mask = td["response_mask"].float()
        td["old_log_probs"] = (lp + 0.05 * torch.randn(lp.shape, generator=g)) * mask
        td["ref_log_prob"] = (lp + 0.10 * torch.randn(lp.shape, generator=g)) * mask


def environment() -> dict:
    import transformers
    import verl

    env = dict(torch=torch.__version__, transformers=transformers.__version__, verl=verl.__version__,
               python=platform.python_version(), smoke=SMOKE, flash_attn=None,
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               cuda=torch.version.cuda, date=datetime.datetime.now().isoformat(timespec="seconds"))
    with contextlib.suppress(ImportError):
        import flash_attn

        env["flash_attn"] = flash_attn.__version__
    return env


def write_report(args, env: dict, stats: dict, rows: dict, agree: dict) -> str:
    lines = [f"# verl's FSDP engine vs the dtree engine: {args.model} on {env['gpu']}", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"One train_batch (verl's ppo_loss: vanilla, token-mean, low_var_kl), mean of {args.steps} steps after "
             "one warm-up (the fp32 reference: one step); peak = torch.cuda.max_memory_allocated.", ""]
    for workload, table in rows.items():
        st = stats[workload]
        lines += [f"## {workload}: {st['num_sequences']} rows, {st['linearized_tokens']} linearized / "
                  f"{st['unique_tokens']} unique tokens ({st['compression_ratio']:.2f}x)", "",
                  "| setting | attention | step (s) | first step (s) | peak (GiB) |", "|---|---|---|---|---|"]
        for r in table:
            if "error" in r:
                lines.append(f"| {r['setting']} | {r.get('attention', '')} | {r['error']} | | |")
            else:
                peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
                lines.append(f"| {r['setting']} | {r['attention']} | {r['seconds']:.3f} | {r['first_seconds']:.3f} | {peak} |")
        lines.append(f"| verl + PrefixGrouper | | not run: {PREFIX_GROUPER} | | |")
        if workload in agree:
            a = agree[workload]
            lines += ["", f"Agreement against the fp32 reference: dtree {a['dtree_error']:.2e}, verl bf16 "
                      f"{a['verl_error']:.2e} (global relative); worst parameter {a['worst_parameter']}: dtree "
                      f"{a['worst_dtree']:.2e}, verl {a['worst_verl']:.2e}; rule (<= 3x verl + {FLOOR}): "
                      f"{'PASS' if a['passed'] else 'FAIL'}"]
        lines.append("")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"verl_engine_{env['gpu'].replace(' ', '_').lower()}_{args.model}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    with open(stem + ".json", "w") as f:
        json.dump(dict(args=vars(args), environment=env, stats=stats, rows=rows, agreement=agree), f, indent=1)
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    check_environment()
    import verl_cpu
    from spawn import free_port, init_gloo
    from verl.workers.utils.losses import ppo_loss
    from verl_reference import VerlSettings

    from dtree.presets import build_model

    cuda = torch.cuda.is_available() and not SMOKE
    if not cuda:
        verl_cpu.use_cpu_platform()
        init_gloo(0, 1, free_port())
    else:
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = build_model(args.model, dtype=torch.float32, device="cuda" if cuda else "cpu")
    path, vocab = verl_cpu.save_model(model), model.config.vocab_size
    del model
    rows_by_workload = make_batches(vocab)
    stats = {}
    for w, (seqs, _, fields) in rows_by_workload.items():
        from dtree import Forest

        stats[w] = Forest.from_sequences(seqs, loss_mask=fields["loss_mask"]).stats().as_dict()
    zeros = {w: r[2]["old_logprobs"] for w, r in rows_by_workload.items()}
    tds = {w: verl_batch(r, zeros[w], zeros[w]) for w, r in rows_by_workload.items()}
    loss_function = functools.partial(ppo_loss, config=VerlSettings(use_kl_loss=True).actor_config(8))
    ref_engine, _ = build_engine(REFERENCE, path)
    old_and_ref_logprobs(ref_engine, tds)
    del ref_engine
    table, grads = {w: [] for w in tds}, {}
    for setting in [REFERENCE, *SETTINGS]:
        rows, g = run_setting(setting, path, tds, loss_function, args, 0 if setting is REFERENCE else args.steps)
        for w, r in rows.items():
            table[w].append(r)
        grads[setting.name] = g
        print(f"{setting.name}: " + ", ".join(f"{w} {r.get('seconds', r.get('error'))}" for w, r in rows.items()),
              flush=True)
    agree = {w: agreement(grads[REFERENCE.name][w], grads[SETTINGS[0].name][w], grads[SETTINGS[3].name][w])
             for w in tds if all(w in grads[s.name] for s in (REFERENCE, SETTINGS[0], SETTINGS[3]))}
    print(write_report(args, environment(), stats, table, agree))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
