"""Built-in model shapes: published configs, random weights, no downloads.

Used by ``dtree bench``, ``dtree calibrate`` and the distributed example. Throughput
and memory depend on a model's shape only, so a config with random weights measures
what the released model would.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

__all__ = [
    "MODEL_PRESETS",
    "DTYPES",
    "build_model",
    "model_config",
    "add_model_arguments",
    "model_from_args",
    "resolve_device",
    "resolve_dtype",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# Published shapes (config.json of each release). Weights are random: throughput and
# memory depend on the shape only.
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=352, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=65536,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
}


def model_config(name_or_path: str):
    """A transformers config from a preset name, a config.json path or a directory holding one."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if name_or_path in MODEL_PRESETS:
        kw = dict(MODEL_PRESETS[name_or_path])
        model_type = kw.pop("model_type")
        return CONFIG_MAPPING[model_type](**kw)
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"unknown model {name_or_path!r}: use one of {sorted(MODEL_PRESETS)} or a path to a HF config.json"
        )
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if "model_type" not in data:
        raise ValueError(f"{path} has no 'model_type'; is it a transformers config.json?")
    return AutoConfig.for_model(**data)


def build_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """Random-weight causal LM of the given shape, created directly on ``device``
    (initializing a 7B model on the CPU first would take minutes). The same seed gives
    the same weights on every rank."""
    from transformers import AutoModelForCausalLM

    config = model_config(name_or_path)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    return model


def resolve_device(name: str | None = "auto") -> torch.device:
    """``auto``: ``cuda:LOCAL_RANK`` when CUDA is available (one GPU per torchrun rank), else cpu."""
    if name in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return torch.device("cpu")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA, fp32 on CPU."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def add_model_arguments(parser: argparse.ArgumentParser, default_model: str = "tiny") -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=default_model,
                   help=f"{', '.join(MODEL_PRESETS)} or a HF config.json path; random weights (default {default_model})")
    g.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if available, else cpu), cpu, cuda:0, ...")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), " + ", ".join(DTYPES))
    g.add_argument("--seed", type=int, default=0, help="weight and workload seed")


def model_from_args(args: argparse.Namespace) -> torch.nn.Module:
    device = resolve_device(args.device)
    return build_model(args.model, device=device, dtype=resolve_dtype(args.dtype, device), seed=args.seed)
