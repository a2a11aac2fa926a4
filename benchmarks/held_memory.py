"""What stays allocated on the GPU between dtree steps, and who holds it (a diagnosis aid).

Runs a few training steps of a small qwen2 (head dim 128) through the runtime, then lists
the CUDA tensors still alive beyond the weights and their gradients, by size, each with the
chain of objects that refer to it (gc referrers, three levels).

    python benchmarks/held_memory.py --attention flash-attn     # H100 with flash-attn-4
    python benchmarks/held_memory.py --attention triton
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dtree  # noqa: E402
from dtree.losses import ppo_clip  # noqa: E402
from dtree.workloads import make_workload  # noqa: E402


def _describe(obj) -> str:
    if isinstance(obj, dict):
        return f"dict({list(obj)[:4]})"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}[{len(obj)}]"
    return type(obj).__qualname__


def _chain(obj, depth: int, seen: set) -> list[str]:
    if depth == 0:
        return []
    out = []
    for r in gc.get_referrers(obj):
        if id(r) in seen or r is seen or isinstance(r, type(sys._getframe())):
            continue
        seen.add(id(r))
        out.append("  " * (4 - depth) + _describe(r))
        out += _chain(r, depth - 1, seen)
        if len(out) > 12:
            break
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", default="auto")
    p.add_argument("--top", type=int, default=6)
    p.add_argument("--model", default=None, help="a dtree preset (default: a 3-layer qwen2 at head dim 128)")
    p.add_argument("--tokens", type=int, default=3000, help="unique tokens per agentic forest")
    args = p.parse_args()
    import transformers

    if args.model:
        from dtree.presets import build_model

        model = build_model(args.model, dtype=torch.bfloat16, device="cuda")
    else:
        cfg = transformers.Qwen2Config(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=128)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).train()
    rt = dtree.TreeRuntime(model, attention=args.attention)
    shape = {} if args.model else {"system_prompt_len": 300, "trajectories": 3, "turn_len": (20, 200)}
    for seed in range(3):
        forest = make_workload("agentic", seed=seed, vocab_size=1000, num_trees=1, target_unique_tokens=args.tokens,
                               **shape)
        out = rt.forward_backward(forest, ppo_clip())
        print(f"step {seed}: {out.metrics.get('memory')}")
    torch.cuda.synchronize()
    gc.collect()
    mine = {id(p) for p in model.parameters()} | {id(p.grad) for p in model.parameters() if p.grad is not None}
    alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda and id(o) not in mine]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"attention {rt.attention}: allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB, weights+grads "
          f"{2 * weights / 2**20:.1f} MiB; {len(alive)} other CUDA tensors alive")
    alive.sort(key=lambda t: -t.untyped_storage().nbytes())
    for t in alive[: args.top]:
        print(f"- {tuple(t.shape)} {t.dtype} storage {t.untyped_storage().nbytes() / 2**20:.2f} MiB")
        print("\n".join(_chain(t, 3, {id(alive)})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
