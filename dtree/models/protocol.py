"""What the runtime needs from a model, and how a custom ``nn.Module`` provides it.

Hugging Face causal LMs need nothing: :class:`dtree.models.hf.HFTreeModel` adapts
them through transformers' attention interface. Any other module implements three
methods (the test suite's nanoGPT does, see ``tests/nanogpt.py``)::

    class MyLM(nn.Module):
        def dtree_spec(self) -> ModelSpec: ...

        def dtree_hidden_states(self, input_ids, position_ids, attend):
            # input_ids, position_ids: [T] int64 (positions are depths in the tree)
            # run the usual blocks; in every attention layer call
            #     out = attend(layer_idx, q, k, v, scale)
            # with q: [T, q_heads, head_dim], k: [T, kv_heads, head_dim],
            # v: [T, kv_heads, v_head_dim] (after any rotary embedding),
            # out: [T, q_heads, v_head_dim]; do not mask or cache anything,
            # attend() handles both. Layers that need them pass keyword options
            # (dtree.ops.stack_attention): softcap=float, sinks=[q_heads] tensor,
            # alibi_slopes=[q_heads] tensor, window=int (sliding window)
            return final_hidden  # [T, hidden] after the final norm

        # recurrent layers (hybrid models): declare them in the spec (layer_kv: None for a
        # layer without attention; recurrent_states: (layer, name, shape) of each state)
        # and run their token mixing through dtree's ops with the call's states:
        #     states = attend.states(layer_idx)
        #     y = dtree.ops.short_conv.causal_conv1d_segments(x, weight, bias, states)
        #     o = dtree.ops.linear_recurrence.linear_recurrence(q, k, v, g, beta, states, scale=...)
        # each packed segment then starts from its parent's state (tests/nanogpt.py: NanoHybrid)

        def dtree_output_layer(self):
            return OutputHead(weight=self.lm_head.weight)  # fused: [vocab, hidden] (+ bias)
            # or OutputHead(module=self.lm_head): any nn.Module [N, hidden] -> [N, vocab],
            # called chunk by chunk (LoRA on the head, a quantized linear, ...);
            # logit_scale= / final_softcap= for models that transform their logits.
            # The older ``return weight, bias`` tuple is still accepted (fused path).

        # optional: refuse a state the module cannot run in, before any compute
        def dtree_check(self, training: bool) -> None: ...

        # optional (recurrent layers): per layer, whether its states can need a gradient
        # now (a trainable parameter feeds them); default: every state read takes one
        def dtree_state_grads(self) -> tuple[bool, ...]: ...

        # optional: a context manager the runtime holds over a whole training step,
        # backward included (the HF adapter keeps its attention switched to dtree's
        # there, for layers that checkpointing re-runs in backward)
        def dtree_scope(self): ...

Called at every step, so the head may change after construction (adapters injected,
dtype or device moves). Dropout in a custom module is replayed exactly like in a
transformers model (see :mod:`dtree.device.rng`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol, runtime_checkable

import torch

from ..ops.logprobs import OutputHead

__all__ = ["ModelSpec", "AttendFn", "TreeModule"]

# attend(layer_idx, q, k, v, scale, *, softcap=None, sinks=None, alibi_slopes=None, window=None) -> out
AttendFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """Shapes the runtime sizes its buffers and checks inputs with."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0
    max_positions: int | None = None  # longest path the model accepts
    # the widest sliding window of the model's layers (the attention applies each layer's
    # own per call); the baselines reject paths longer than it
    sliding_window: int | None = None
    name: str = "model"
    v_head_dim: int | None = None  # value head dim when it differs from head_dim (MLA)
    # Hybrid models and per-layer attention shapes. ``layer_kv``: per decoder layer, the
    # (kv_heads, head_dim, v_head_dim) its attention receives, or None for a layer without
    # attention; None (the default): every layer attends with the fields above.
    # ``recurrent_states``: (layer, name, shape) of every state a recurrent layer carries
    # along the sequence (a conv window, a recurrent or SSM state; dtree.stacks.state_stack).
    layer_kv: tuple[tuple[int, int, int] | None, ...] | None = None
    recurrent_states: tuple[tuple[int, str, tuple[int, ...]], ...] = ()

    @property
    def value_head_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def kv_shape(self, layer: int) -> tuple[int, int, int] | None:
        """(kv_heads, head_dim, v_head_dim) of ``layer``'s attention; None: no attention."""
        if self.layer_kv is None:
            return self.num_kv_heads, self.head_dim, self.value_head_dim
        return self.layer_kv[layer]

    # The derived figures below are cached on the (frozen) instance: the memory policy
    # reads them for each of its ~660 candidate plans per step.
    @cached_property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (every layer unless ``layer_kv`` says otherwise)."""
        return tuple(i for i in range(self.num_layers) if self.kv_shape(i) is not None)

    @cached_property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers that carry recurrent states, in order."""
        return tuple(sorted({layer for layer, _, _ in self.recurrent_states}))

    @cached_property
    def _kv_elements(self) -> int:
        return sum(h * (d + dv) for h, d, dv in (self.kv_shape(i) for i in self.attention_layers))

    def kv_elements_per_token(self) -> int:
        """K and V elements one token leaves on the KV stack, over every attending layer."""
        return self._kv_elements

    @cached_property
    def _state_elements(self) -> int:
        return sum(int(torch.Size(shape).numel()) for _, _, shape in self.recurrent_states)

    def state_elements(self) -> int:
        """Elements of one segment's recurrent states, over every recurrent layer."""
        return self._state_elements

    def forward_flops_per_token(self) -> float:
        """Matmul FLOPs of one token's forward, excluding attention scores."""
        return self._forward_flops

    @cached_property
    def _forward_flops(self) -> float:
        h, d, dv = self.hidden_size, self.head_dim, self.value_head_dim
        attn_proj = 2 * h * (d + dv) * (self.num_heads + self.num_kv_heads)  # q, k (d wide); v, o (dv wide)
        mlp = 2 * 3 * h * self.intermediate_size  # gate, up, down
        return self.num_layers * (attn_proj + mlp) + 2 * h * self.vocab_size

    def forward_attention_flops_per_key(self) -> float:
        """FLOPs of one (query, key) pair in the forward: QK^T and PV over the attending
        layers (every query head reads its K/V group's head dims)."""
        return self._attention_flops_per_key

    @cached_property
    def _attention_flops_per_key(self) -> float:
        return sum(2 * self.num_heads * (d + dv) for _, d, dv in (self.kv_shape(i) for i in self.attention_layers))

    def training_flops(self, positions: torch.Tensor | list[int] | int) -> float:
        """Forward + backward FLOPs (3x forward) of tokens at the given positions.

        A token at position ``p`` attends to ``p + 1`` keys. Pass an int ``n`` for one
        causal sequence of ``n`` tokens."""
        if isinstance(positions, int):
            n, keys = positions, positions * (positions + 1) / 2
        else:
            pos = torch.as_tensor(positions, dtype=torch.float64)
            n, keys = pos.numel(), float((pos + 1).sum())
        return 3.0 * (n * self.forward_flops_per_token() + keys * self.forward_attention_flops_per_key())


@runtime_checkable
class TreeModule(Protocol):
    def dtree_spec(self) -> ModelSpec: ...

    def dtree_hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor: ...

    def dtree_output_layer(self) -> OutputHead | tuple[torch.Tensor, torch.Tensor | None]: ...
