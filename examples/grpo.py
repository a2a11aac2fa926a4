"""A GRPO loop that learns, with dtree as the training backend.

Every step: the model samples G answers per prompt (``model.generate``, at the sampling
temperature, full softmax); an answer that emits a tool-call token gets the toy tool's
result appended and ``--branches`` continuations sampled from that shared prefix, so
the rollouts are trees with more than one level (prompt -> first turns -> tool result ->
continuations). A programmatic reward scores each answer; advantages are normalized
within each prompt's group (GRPO). The answers become one forest
(``Forest.from_sequences``, loss on the model's own tokens only, one advantage per
sequence, old log-probs from ``rt.logprobs`` at the sampling temperature), and the
policy is updated with ``ppo_clip`` under a named aggregation (TRL's ``grpo`` by
default), optionally with a KL penalty to a frozen copy of the initial model.

The toy task, sized to the vocabulary ``V``: a token is *lucky* when its id is in
``[V/16, V/8)`` (1 in 16 at random init); the reward of an answer is the fraction of its
own tokens (tool calls aside) that are lucky, plus ``--tool-bonus`` when it called the
tool (the top ``V/64`` ids are tool calls; the tool answers with four lucky tokens that
depend on the prompt). A random-weight model starts near 0.06 and learns to emit lucky
tokens within a few minutes on a CPU.

    python examples/grpo.py                                   # tiny model, CPU, 1-3 minutes
    python examples/grpo.py --model qwen2.5-0.5b --device cuda --method linearized --steps 10

Per step it logs the reward, KL (to the initial model), clip fraction, entropy, the
update's tokens/s (linearized tokens trained per second) and peak memory, and the
forest's size; it writes ``<out>.json`` (the history, rewritten after every step, so an
interrupted run keeps what it finished; Ctrl-C also draws the plot and exits with 130)
and ``<out>.png`` (the curves). ``<out>`` defaults to ``./dtree-results/grpo_<model>_<method>``:
the committed ``examples/results`` are never overwritten unless ``--out`` names them.
``--method linearized`` runs the same loop, the same rollouts and log-probs, with the
update through ``dtree.baselines.LinearizedTrainer`` (every answer computed on its own),
for comparing the update's time and memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import time
from dataclasses import dataclass

import numpy as np
import torch

import dtree
from dtree.baselines import LinearizedTrainer
from dtree.losses import aggregation, ppo_clip
from dtree.presets import MODEL_PRESETS, build_model, resolve_device, resolve_dtype

DEFAULT_OUT = "dtree-results"  # as dtree bench's: relative to the working directory, git-ignored


# ---------------------------------------------------------------------- the toy task
@dataclass(frozen=True)
class Task:
    """Token ranges of the toy task for a vocabulary of ``vocab`` ids."""

    vocab: int
    tool_bonus: float = 0.1
    pad: int = 0
    eos: int = 1

    @property
    def lucky(self) -> tuple[int, int]:
        return self.vocab // 16, self.vocab // 8

    @property
    def tool_calls(self) -> list[int]:
        """Ids that call the tool (the top V/64)."""
        return list(range(self.vocab - self.vocab // 64, self.vocab))

    def is_tool_call(self, token: int) -> bool:
        return token >= self.vocab - self.vocab // 64

    def tool_result(self, prompt: list[int]) -> list[int]:
        """The tool's answer: four lucky tokens derived from the prompt."""
        lo, hi = self.lucky
        return [lo + (prompt[i % len(prompt)] * 7 + i) % (hi - lo) for i in range(4)]

    def prompts(self, n: int, length: int, generator: torch.Generator) -> list[list[int]]:
        """Random prompts of ``length`` ordinary tokens (no pad, EOS or tool call)."""
        return torch.randint(2, self.vocab - self.vocab // 64, (n, length), generator=generator).tolist()

    def reward(self, answer: "Answer") -> float:
        own = [t for t, g in zip(answer.tokens, answer.generated) if g and not self.is_tool_call(t) and t != self.eos]
        lo, hi = self.lucky
        lucky = sum(lo <= t < hi for t in own) / max(len(own), 1)
        return lucky + (self.tool_bonus if answer.used_tool else 0.0)


@dataclass
class Answer:
    """One root-to-leaf rollout: its prompt's index (its GRPO group), every token (prompt,
    turns, tool result) and which of them the model sampled (the loss mask)."""

    group: int
    tokens: list[int]
    generated: list[int]
    used_tool: bool = False


# ---------------------------------------------------------------------- rollouts
def _cut(new: list[int], stops: set[int]) -> list[int]:
    """The sampled tokens up to and including the first stop token."""
    for i, t in enumerate(new):
        if t in stops:
            return new[: i + 1]
    return new


@torch.no_grad()
def _sample(model, prefixes: list[list[int]], stops: list[int], args, task: Task) -> list[list[int]]:
    """One sampled turn per prefix (left-padded batch), cut at the first stop token."""
    device = next(model.parameters()).device
    width = max(map(len, prefixes))
    ids = torch.tensor([[task.pad] * (width - len(p)) + p for p in prefixes], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes], device=device)
    out = model.generate(
        # top_k=0, top_p=1: the full softmax(logits / T), the distribution the loss scores
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
        max_new_tokens=args.max_new, eos_token_id=stops, pad_token_id=task.pad,
    )
    stop_set = set(stops)
    return [_cut(row[width:].tolist(), stop_set) for row in out]


def rollout(model, prompts: list[list[int]], task: Task, args) -> list[Answer]:
    """G first turns per prompt; each turn that ends in a tool call gets the tool's result
    and ``args.branches`` continuations (a shared prefix: a deeper tree)."""
    model.eval()
    first = _sample(model, [p for p in prompts for _ in range(args.group_size)], [task.eos] + task.tool_calls, args, task)
    answers, pending = [], []
    for i, turn in enumerate(first):
        group = i // args.group_size
        prompt = prompts[group]
        if turn and task.is_tool_call(turn[-1]):
            prefix = prompt + turn + task.tool_result(prompt)
            generated = [0] * len(prompt) + [1] * len(turn) + [0] * 4
            pending += [(group, prefix, generated)] * args.branches
        else:
            answers.append(Answer(group, prompt + turn, [0] * len(prompt) + [1] * len(turn)))
    if pending:
        second = _sample(model, [p for _, p, _ in pending], [task.eos], args, task)
        for (group, prefix, generated), turn in zip(pending, second):
            answers.append(Answer(group, prefix + turn, generated + [1] * len(turn), used_tool=True))
    model.train()
    return [a for a in answers if len(a.tokens) > 1]


def group_advantages(rewards: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """GRPO: each reward minus its group's mean, over the group's std (+1e-4)."""
    adv = np.zeros_like(rewards)
    for g in np.unique(groups):
        r = rewards[groups == g]
        adv[groups == g] = (r - r.mean()) / (r.std() + 1e-4)
    return adv


# ---------------------------------------------------------------------- training
def peak_memory(device: torch.device) -> tuple[float, str]:
    """(GB, what it is): the update's peak allocated CUDA memory, or the process's
    maximum resident set size on CPU (a high-water mark over the whole run)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "peak allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "max RSS"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"{', '.join(MODEL_PRESETS)} or a HF config.json (random weights)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda:0, ...")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), bf16, fp32, ...")
    p.add_argument("--method", default="dtree", choices=["dtree", "linearized"], help="the update's backend")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="G: first turns sampled per prompt")
    p.add_argument("--branches", type=int, default=2, help="continuations sampled after each tool call")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new", type=int, default=12, help="most tokens per turn")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the loss uses it too)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout batch (PPO epochs)")
    p.add_argument("--clip", type=float, default=0.2, help="epsilon (clip-higher: --clip-high)")
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument("--aggregation", default="grpo", help="a TRL loss_type or verl loss_agg_mode (dtree.losses.aggregation)")
    p.add_argument("--kl-coef", type=float, default=0.01, help="KL to a frozen copy of the initial model (0: no copy)")
    p.add_argument("--tool-bonus", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-tokens", type=int, default=None, help="dtree: tokens per model call (default: auto)")
    p.add_argument("--out", default=None, help=f"output prefix (default ./{DEFAULT_OUT}/grpo_<model>_<method>, in the "
                   "working directory; git-ignored in a dtree checkout, so the committed examples/results stay)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def update_step(trainer, optimizer, forest, loss, args, device) -> tuple[dict, float]:
    """``args.updates`` optimizer steps on one forest: (the loss's metrics per update, seconds)."""
    t_update, metrics = 0.0, {}
    for _ in range(args.updates):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t1 = time.perf_counter()
        res = trainer.forward_backward(forest, loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t_update += time.perf_counter() - t1
        for k in ("kl", "entropy", "clip_ratio/region_mean"):
            if k in res.metrics:
                metrics.setdefault(k, []).append(res.metrics[k])
    return metrics, t_update


def history_row(step, task, answers, rewards, forest, metrics, t_update, t_gen, t0, args, device) -> dict:
    memory, memory_kind = peak_memory(device)
    stats = forest.stats()
    return {
        "step": step,
        "reward": float(rewards.mean()),
        "lucky": float(np.mean([task.reward(a) - (task.tool_bonus if a.used_tool else 0) for a in answers])),
        "tool_calls": float(np.mean([a.used_tool for a in answers])),
        "kl": float(np.mean(metrics["kl"])) if "kl" in metrics else 0.0,
        # the last update of the batch: the first one is on-policy (ratio 1, never clipped)
        "clip_fraction": metrics["clip_ratio/region_mean"][-1],
        "entropy": metrics["entropy"][0],
        "tokens_per_s": args.updates * stats.linearized_tokens / t_update,
        "peak_memory_gb": memory,
        "memory_kind": memory_kind,
        "update_s": t_update / args.updates,
        "generate_s": t_gen,
        "step_s": time.perf_counter() - t0,
        "sequences": stats.num_sequences,
        "unique_tokens": stats.unique_tokens,
        "linearized_tokens": stats.linearized_tokens,
        "compression": stats.compression_ratio,
        "max_depth": stats.max_depth,
    }


def write_history(out: str, info: dict, history: list[dict]) -> None:
    """``<out>.json``, rewritten after every step (atomically): an interrupted run keeps
    the steps it finished."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json.tmp", "w") as f:
        json.dump({"info": info, "history": history}, f, indent=1)
    os.replace(out + ".json.tmp", out + ".json")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed)
    task = Task(model.config.vocab_size, tool_bonus=args.tool_bonus)
    rt = dtree.TreeRuntime(model, group_tokens=args.group_tokens)  # rollout log-probs, and dtree's update
    trainer = rt if args.method == "dtree" else LinearizedTrainer(model)
    ref_rt = None
    if args.kl_coef:
        ref_rt = dtree.TreeRuntime(copy.deepcopy(model).eval().requires_grad_(False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    loss = ppo_clip(
        args.clip, epsilon_high=args.clip_high, kl_coef=args.kl_coef, temperature=args.temperature, log_entropy=True,
        **aggregation(args.aggregation, max_completion_length=2 * args.max_new),
    )
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    out = args.out or os.path.join(DEFAULT_OUT, f"grpo_{args.model}_{args.method}")
    info = {
        "args": vars(args), "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "interrupted": False,
    }
    history: list[dict] = []

    from tqdm import tqdm

    bar = tqdm(range(args.steps), desc=f"grpo {args.method}", unit="step")
    try:
        for step in bar:
            t0 = time.perf_counter()
            prompts = task.prompts(args.prompts, args.prompt_len, gen)
            answers = rollout(model, prompts, task, args)
            t_gen = time.perf_counter() - t0
            rewards = np.array([task.reward(a) for a in answers])
            groups = np.array([a.group for a in answers])
            forest = dtree.Forest.from_sequences(
                [a.tokens for a in answers], loss_mask=[a.generated for a in answers],
                advantages=group_advantages(rewards, groups).tolist(),  # one per sequence, broadcast
            )
            forest = forest.with_fields(old_logprobs=rt.logprobs(forest, temperature=args.temperature))
            if ref_rt is not None:
                forest = forest.with_fields(ref_logprobs=ref_rt.logprobs(forest, temperature=args.temperature))
            metrics, t_update = update_step(trainer, optimizer, forest, loss, args, device)
            row = history_row(step, task, answers, rewards, forest, metrics, t_update, t_gen, t0, args, device)
            history.append(row)
            write_history(out, info, history)
            bar.set_postfix(reward=f"{row['reward']:.3f}", kl=f"{row['kl']:.4f}", clip=f"{row['clip_fraction']:.3f}",
                            H=f"{row['entropy']:.2f}", tok_s=f"{row['tokens_per_s']:.0f}",
                            mem=f"{row['peak_memory_gb']:.2f}GB")
    except KeyboardInterrupt:
        bar.close()
        info["interrupted"] = True
        print(f"interrupted after {len(history)} of {args.steps} steps; writing what finished", flush=True)
    write_history(out, info, history)
    if history and not args.no_plot:
        plot(history, out + ".png", f"GRPO on the toy task: {args.model}, {device.type}, update through {args.method}")
    if history:
        print(summary(history))
    print(f"wrote {out}.json" + ("" if args.no_plot or not history else f" and {out}.png"))
    if info["interrupted"]:
        raise SystemExit(130)
    return history


def summary(history: list[dict]) -> str:
    n = max(1, len(history) // 5)
    first, last = history[:n], history[-n:]

    def mean(rows, k):
        return float(np.mean([r[k] for r in rows]))

    steady = history[1:] or history  # the first step pays one-time costs
    return (
        f"reward {mean(first, 'reward'):.3f} (first {n} steps) -> {mean(last, 'reward'):.3f} (last {n}); "
        f"update {mean(steady, 'update_s'):.3f} s, {mean(steady, 'tokens_per_s'):.0f} tokens/s, "
        f"peak memory {max(r['peak_memory_gb'] for r in history):.2f} GB ({history[-1]['memory_kind']}); "
        f"compression {mean(history, 'compression'):.2f}x, max depth {max(r['max_depth'] for r in history)} nodes"
    )


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", "reward (mean over answers)"), ("kl", "KL to the initial model"),
        ("clip_fraction", "clip fraction"), ("entropy", "entropy (nats)"),
        ("tokens_per_s", "update tokens/s"), ("peak_memory_gb", f"memory (GB, {history[-1]['memory_kind']})"),
    ]
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, label) in zip(axes.flat, panels):
        ax.plot(steps, [r[key] for r in history], lw=1.5, label=key)
        if key == "reward":  # its two parts
            ax.plot(steps, [r["lucky"] for r in history], lw=1, ls="--", label="lucky fraction")
            ax.plot(steps, [r["tool_calls"] for r in history], lw=1, ls=":", label="answers that called the tool")
            ax.legend(fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
