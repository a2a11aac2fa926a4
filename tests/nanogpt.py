"""A nanoGPT-style model (learned positions, LayerNorm, GELU MLP, tied head) that
implements dtree's TreeModule protocol, plus its ordinary causal forward used as
the reference."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dtree.models import ModelSpec


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)  # residual dropout, as GPT-2
        self.heads, self.hd = heads, d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, attend):  # x: [T, d]
        t = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(t, 3, self.heads, self.hd).unbind(1)
        x = x + self.drop(self.proj(attend(q, k, v).reshape(t, -1)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class NanoGPT(nn.Module):
    def __init__(
        self, vocab: int = 61, d: int = 48, heads: int = 4, layers: int = 2, block_size: int = 256, dropout: float = 0.0
    ):
        super().__init__()
        self.vocab, self.d, self.heads, self.block_size = vocab, d, heads, block_size
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    # --- the ordinary causal LM (reference)
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: [T] -> logits [T, vocab]."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[0]))

        def causal(q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            return out.transpose(0, 1)

        for b in self.blocks:
            x = b(x, causal)
        return self.lm_head(self.ln_f(x))

    # --- dtree.models.TreeModule
    def dtree_spec(self) -> ModelSpec:
        hd = self.d // self.heads
        return ModelSpec(
            num_layers=len(self.blocks), num_heads=self.heads, num_kv_heads=self.heads, head_dim=hd,
            hidden_size=self.d, vocab_size=self.vocab, intermediate_size=4 * self.d,
            max_positions=self.block_size, name="nanogpt",
        )

    def dtree_hidden_states(self, input_ids, position_ids, attend):
        x = self.wte(input_ids) + self.wpe(position_ids)
        scale = (self.d // self.heads) ** -0.5
        for i, b in enumerate(self.blocks):
            x = b(x, lambda q, k, v, i=i: attend(i, q, k, v, scale))
        return self.ln_f(x)

    def dtree_output_layer(self):
        return self.lm_head.weight, None


class NanoGPTWithoutLayerList(NanoGPT):
    """The same model with its blocks outside any ``nn.ModuleList`` attribute (a plain
    list built per call): per-layer checkpointing cannot find the decoder layers."""

    def __init__(self):
        super().__init__()
        self.stages = self.blocks
        del self.blocks

    def dtree_spec(self):
        self.blocks = list(self.stages)  # a plain list: not found as the layer list
        return super().dtree_spec()
