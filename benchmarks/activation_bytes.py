"""Bytes a decoder layer keeps for backward, per token, for each way of running the
layers (issue 17 item 3: fewer bytes per retained token). Exact, on CPU.

A model of a preset's layer shapes (default qwen2.5-1.5b: hidden 1536, intermediate
8960, 12/2 heads of 128) with 1 and with 2 decoder layers and a small vocabulary runs
one dtree model call of ``T1`` and of ``T2`` tokens with grad (the call's own attention
backend, ``sdpa`` on CPU), in the model dtype (bf16 by default). Per layer and token:

    (kept(L=2, T2) - kept(L=2, T1) - kept(L=1, T2) + kept(L=1, T1)) / (T2 - T1)

where ``kept`` is read two ways: the distinct storages autograd saves
(``torch.autograd.graph.saved_tensors_hooks``; blind to what checkpointing keeps,
which bypasses the hooks) and the storages the call created that are still alive
after its forward (:class:`dtree.plan.memory_probe.LiveBytes`, which sees everything).
Layer settings:

* ``eager``: HF's layers as they are;
* ``liger``: Liger-Kernel's RMSNorm/SwiGLU/rotary (``dtree.models.fused``; on CPU its
  Triton kernels run under the interpreter: ``--liger`` re-runs the script with
  ``TRITON_INTERPRET=1`` and the test suite's interpreter shims);
* ``lean``: dtree's lean layers (``dtree.models.lean_layers``);
* ``sac``: HF's layers under selective activation checkpointing
  (``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``): the
  outputs of matmuls and of the attention are saved, elementwise ops recomputed;
* ``lean+sac``: both;
* ``ckpt``: every layer checkpointed (``dtree.models.checkpointing``): its input only.

    python benchmarks/activation_bytes.py --out benchmarks/results          # ~1 min on 2 cores
    python benchmarks/activation_bytes.py --model qwen2.5-7b --settings eager,lean,ckpt
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

SETTINGS = ("eager", "liger", "lean", "sac", "lean+sac", "ckpt")
GIB = 2.0**30


def build(preset: str, layers: int, dtype: torch.dtype, setting: str, vocab: int = 512):
    from transformers import AutoModelForCausalLM

    from dtree.models import adapt
    from dtree.presets import MODEL_PRESETS

    kw = dict(MODEL_PRESETS[preset])
    kw.update(num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False)
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[kw.pop("model_type")](**kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    if "lean" in setting:
        from dtree.models.lean_layers import apply_lean_layers

        apply_lean_layers(model)
    if setting == "liger":
        from dtree.models.fused import apply_fused_kernels

        apply_fused_kernels(model)
    return model, adapt(model)


def _sac_policy(ctx, op, *args, **kwargs):
    """Save what is costly to recompute (matmuls, attention), recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = str(op)
    costly = any(k in name for k in ("aten.mm", "aten.addmm", "aten.bmm", "scaled_dot_product", "aten.linear"))
    return CheckpointPolicy.MUST_SAVE if costly else CheckpointPolicy.PREFER_RECOMPUTE


class _SelectiveLayer(torch.nn.Module):
    """A decoder layer under selective activation checkpointing."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        import contextvars

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        ctx = contextvars.copy_context()
        return checkpoint(
            functools.partial(ctx.run, self.layer), *args, use_reentrant=False,
            context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy), **kwargs,
        )


def kept_bytes(model, adapter, tokens: int, setting: str) -> tuple[int, int]:
    """(bytes saved through saved-tensor hooks, bytes alive after the forward) of one call."""
    from dtree.models.checkpointing import checkpointed_layers, decoder_layers
    from dtree.plan.memory_probe import LiveBytes, _probe_call

    spec = adapter.dtree_spec()
    placement = (torch.device("cpu"), next(model.parameters()).dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    layers = decoder_layers(model)
    originals = list(layers)
    if "sac" in setting:
        for i, layer in enumerate(originals):
            layers[i] = _SelectiveLayer(layer)
    try:
        ctx = checkpointed_layers(model) if setting == "ckpt" else _nothing()
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.random.fork_rng(), ctx, LiveBytes() as live, hooks:
            out = _probe_call(adapter, spec, placement, "sdpa", tokens, [])
        alive = live.now()
        del out
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    return sum(saved.values()), alive


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def per_layer(preset: str, dtype: torch.dtype, setting: str, tokens=(64, 192)) -> dict:
    """Per token: one layer's bytes (saved through hooks, and alive), and the rest of the
    call's (embeddings, final norm, rotary tables)."""
    t1, t2 = tokens
    kept = {}
    for layers in (1, 2):
        model, adapter = build(preset, layers, dtype, setting)
        kept[layers] = [kept_bytes(model, adapter, t, setting) for t in (t1, t2)]
    out = {}
    for i, name in enumerate(("saved", "alive")):
        slope = {n: (kept[n][1][i] - kept[n][0][i]) / (t2 - t1) for n in (1, 2)}
        out[f"{name}_per_layer"] = slope[2] - slope[1]
        out[f"{name}_rest"] = 2 * slope[1] - slope[2]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--settings", default="eager,lean,sac,lean+sac,ckpt")
    p.add_argument("--liger", action="store_true", help="also Liger's layers (under the Triton interpreter)")
    p.add_argument("--out", default=None, help="directory for activation_bytes_<model>.md/.json")
    args = p.parse_args(argv)
    if args.liger and os.environ.get("TRITON_INTERPRET") != "1":  # must be set before Triton is imported
        import subprocess

        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env=env)
    if args.liger:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from interpreter_worker import patch_interpreter

        patch_interpreter()
        from test_fused import _liger_on_interpreter

        _liger_on_interpreter()
    from dtree.presets import DTYPES, MODEL_PRESETS

    dtype = DTYPES[args.dtype]
    settings = [s for s in args.settings.split(",") if s]
    if args.liger and "liger" not in settings:
        settings.append("liger")
    # Liger patches the family's modeling module for the whole process: measure it last
    settings = [s for s in settings if s != "liger"] + (["liger"] if "liger" in settings else [])
    shape = MODEL_PRESETS[args.model]
    layers = shape["num_hidden_layers"]
    rows = []
    for setting in settings:
        r = per_layer(args.model, dtype, setting)
        r.update(setting=setting, call_mb=(r["alive_per_layer"] * layers + r["alive_rest"]) / 1e6)
        rows.append(r)
        print(f"{setting:>9}: {r['alive_per_layer'] / 1e3:7.1f} KB per layer-token alive "
              f"({r['saved_per_layer'] / 1e3:7.1f} KB through saved-tensor hooks), "
              f"rest {r['alive_rest'] / 1e3:6.1f} KB; "
              f"a {layers}-layer call {r['call_mb']:.2f} MB per token", flush=True)
    report = {"model": args.model, "dtype": args.dtype, "layers": layers, "torch": torch.__version__, "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"activation_bytes_{args.model}")
        with open(base + ".json", "w") as f:
            json.dump(report, f, indent=1)
        with open(base + ".md", "w") as f:
            f.write(_markdown(report))
        print(f"reports: {base}.md, {base}.json")
    return 0


def _markdown(report: dict) -> str:
    lines = [
        f"# Activation bytes per token: {report['model']} layers, {report['dtype']}, CPU (exact)",
        "",
        f"torch {report['torch']}; `benchmarks/activation_bytes.py` (per layer: the difference of 1- and 2-layer "
        "models; alive = storages the call created that live after its forward, saved = distinct storages "
        "through saved-tensor hooks)",
        "",
        "| layers | KB per layer-token (alive) | (saved-tensor hooks) | rest of the call, KB per token | "
        f"MB per token, {report['layers']}-layer call |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| `{r['setting']}` | {r['alive_per_layer'] / 1e3:.1f} | {r['saved_per_layer'] / 1e3:.1f} | "
                     f"{r['alive_rest'] / 1e3:.1f} | {r['call_mb']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
