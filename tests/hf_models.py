"""Tiny transformers models with random weights, one per architecture family.

Odd sizes on purpose (vocab 97, head_dim 12, 3 query heads per KV head) so that
shape mistakes do not cancel out.
"""

from __future__ import annotations

import types

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 97


def _common(tied: bool, max_positions: int) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )


def make_config(arch: str, tied: bool = False, max_positions: int = 4096):
    kw = _common(tied, max_positions)
    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "qwen2":  # q/k/v biases, and a sliding window that is off by default
        return Qwen2Config(**kw)
    if arch == "qwen3":  # q_norm / k_norm before rotary
        return Qwen3Config(**kw)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **kw)
    raise ValueError(arch)


ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def make_model(arch: str, tied: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0, max_positions: int = 4096):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, tied, max_positions))
    # random init leaves biases at zero: give them values so the bias gradients are tested
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model.to(dtype)


def _float64_rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF's RMSNorm (``weight * x / rms(x)``) without its float32 round trip."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def make_golden_model(arch: str, tied: bool = False, seed: int = 0):
    """A float64 model that computes in float64 throughout: a golden reference.

    HF's float64 models still round to float32 in two places: RMSNorm (``x.to(float32)``
    and back: its backward rounds every gradient through it) and the eager attention's
    softmax (``dtype=torch.float32``). Here every RMSNorm keeps float64 and attention is
    SDPA (float64 math on CPU), so per-path HF training is exact to float64 rounding and
    dtree can be held to 1e-12 (as FlexAttention's tests hold kernels to a float64
    reference). dtree's own attention ignores the model's implementation."""
    model = make_model(arch, tied=tied, dtype=torch.float64, seed=seed)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_float64_rms_norm, module)
    model.set_attn_implementation("sdpa")
    return model
