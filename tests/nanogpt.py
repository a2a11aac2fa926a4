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


class ConvRecurrentMixer(nn.Module):
    """A recurrent token mixer written against dtree's ops: a short causal convolution,
    then decayed linear attention (per-head decay from the input). ``forward(x, states)``
    runs one packed call through ``states`` (``attend.states(layer)``); ``reference(x)``
    runs one whole sequence from zero states with the naive ops."""

    def __init__(self, d: int, heads: int, kernel: int = 3):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.conv = nn.Conv1d(d, d, kernel, groups=d)
        self.qkv, self.decay, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, heads), nn.Linear(d, d)

    def state_shapes(self) -> dict:
        return {"conv": (self.conv.kernel_size[0] - 1, self.conv.in_channels), "recurrent": (self.heads, self.hd, self.hd)}

    def _mix(self, x, conv, recur):
        t = x.shape[0]
        q, k, v = F.silu(conv(x)).matmul(self.qkv.weight.t()).add(self.qkv.bias).view(t, 3, self.heads, self.hd).unbind(1)
        g = -F.softplus(self.decay(x))
        return self.proj(recur(q, k, v, g).reshape(t, -1))

    def forward(self, x, states):
        from dtree.ops.linear_recurrence import linear_recurrence
        from dtree.ops.short_conv import causal_conv1d_segments

        weight = self.conv.weight.squeeze(1)
        return self._mix(
            x, lambda y: causal_conv1d_segments(y, weight, self.conv.bias, states),
            lambda q, k, v, g: linear_recurrence(q, k, v, g, None, states, scale=self.hd**-0.5),
        )

    def reference(self, x):
        from dtree.ops.linear_recurrence import recurrence_naive
        from dtree.ops.short_conv import causal_conv1d_reference

        weight = self.conv.weight.squeeze(1)
        return self._mix(
            x, lambda y: causal_conv1d_reference([y], weight, self.conv.bias, [None])[0][0],
            lambda q, k, v, g: recurrence_naive(q, k, v, g, None, None, self.hd**-0.5)[0],
        )


class NanoHybrid(NanoGPT):
    """NanoGPT whose first block mixes tokens with :class:`ConvRecurrentMixer` instead of
    attention: a custom TreeModule with a recurrent layer (``ModelSpec.layer_kv`` and
    ``recurrent_states``; ``attend.states(layer)``)."""

    def __init__(self):
        super().__init__(layers=2)
        self.mixer = ConvRecurrentMixer(self.d, self.heads)

    def _run(self, x, attend_of, mix):
        x = x + mix(self.blocks[0].ln1(x))
        x = x + self.blocks[0].out(F.gelu(self.blocks[0].fc(self.blocks[0].ln2(x))))
        return self.blocks[1](x, attend_of(1))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[0]))

        def causal(q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
            return out.transpose(0, 1)

        return self.lm_head(self.ln_f(self._run(x, lambda i: causal, self.mixer.reference)))

    def dtree_spec(self) -> ModelSpec:
        hd = self.d // self.heads
        spec = super().dtree_spec()
        states = tuple((0, name, shape) for name, shape in self.mixer.state_shapes().items())
        return ModelSpec(**{**spec.__dict__, "layer_kv": (None, (self.heads, hd, hd)), "recurrent_states": states})

    def dtree_hidden_states(self, input_ids, position_ids, attend):
        x = self.wte(input_ids) + self.wpe(position_ids)
        scale = (self.d // self.heads) ** -0.5
        hidden = self._run(
            x, lambda i: (lambda q, k, v: attend(i, q, k, v, scale)), lambda y: self.mixer(y, attend.states(0))
        )
        return self.ln_f(hidden)
