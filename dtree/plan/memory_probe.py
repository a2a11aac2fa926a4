"""What one model call keeps for backward, per token, measured on the model as it is
(its layers, kernels, adapters, dtype and device): the memory policy's activation
figures (:class:`CallBytes`).

:func:`measure_call_bytes` runs the model on two synthetic one-segment calls (``T1`` and
``T2`` tokens) with grad, once with no decoder layer checkpointed and once with every
layer checkpointed, and reads the bytes each call's graph holds when its forward has
returned: on CUDA the allocator's count (``torch.cuda.memory_allocated``), elsewhere the
storages created under :class:`LiveBytes` that are still alive. The slope over ``T``
is the per-token figure (constant parts such as the rotary tables drop out). Nothing is
backpropagated, so ``param.grad`` is untouched, and the RNG state is restored.

Why measure: the analytic figure (:func:`layer_activation_bytes`)
is for HF's eager layers; fused or lean layers, adapters and other families keep
other amounts (``benchmarks/activation_bytes.py`` tabulates them), and a plan built on
the wrong figure either runs out of memory or wastes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..models import ModelSpec, TreeModule
from ..models.checkpointing import checkpointed_layers
from ..models.layer_recompute import graph_nodes, rerun_graph_hooks
from ..ops.backward_once import backward_once_scope
from ..ops.segment_states import StateLayout
from ..ops.stack_attention.segment_layout import SegmentLayout
from ..stacks.group_attention import GroupAttention
from ..stacks.step_stacks import StepStacks

__all__ = [
    "CallBytes", "LiveBytes", "attention_is_plain", "estimated_call_bytes", "layer_activation_bytes", "layer_input_bytes", "measure_call_bytes",
]

PROBE_TOKENS = (128, 384)


@dataclass(frozen=True)
class CallBytes:
    """Bytes per token a model call keeps between its forward and its backward.

    Attributes:
        full: with no decoder layer checkpointed (the call's output included).
        checkpointed: with every decoder layer checkpointed (each keeps its input).
        layers: decoder layers.
        layer_input: one layer's input per token (what a checkpointed layer keeps).
        source: ``"measured"`` or ``"estimated"`` (HF's eager layers, from the shapes).
        backward_full, backward_checkpointed: the most a call's backward adds above what
            it kept, per token (measured; None: :meth:`backward`'s estimate).
    """

    full: float
    checkpointed: float
    layers: int
    layer_input: float
    source: str = "measured"
    backward_full: float | None = None
    backward_checkpointed: float | None = None

    @property
    def per_layer(self) -> float:
        """What one layer that is not checkpointed keeps, per token."""
        return max(self.layer_input, (self.full - self.checkpointed) / max(1, self.layers) + self.layer_input)

    def call(self, checkpointed_layers: int) -> float:
        """Per token, with ``checkpointed_layers`` of the layers checkpointed."""
        k = min(max(0, checkpointed_layers), self.layers)
        return self.full - k * (self.per_layer - self.layer_input)

    def backward(self, checkpointed_layers: int) -> float:
        """Per token, the most a call's backward adds above what it kept: one layer's
        activation gradients while it is backpropagated, and with checkpointed layers
        the re-run layer's activations besides. Estimated (no measurement) as half a
        layer's activations and one layer's: HF's eager MLP backward holds about three
        of its four ``[T, I]`` tensors' gradients at once, and tree-mask training with
        every layer checkpointed peaked at its inputs plus one eager layer's activations
        (17.6 GiB on the 64k tree)."""
        measured = self.backward_checkpointed if checkpointed_layers > 0 else self.backward_full
        if measured is not None:
            return measured
        return (1.0 if checkpointed_layers > 0 else 0.5) * self.per_layer

    def freed_at_last_layer(self, checkpointed_layers: int) -> float:
        """Per token, what a call's backward has freed of what its layers kept when it reaches its
        bottom layer: every layer's but that one's (a checkpointed layer's input, another layer's
        activations; nothing on the device for an input waiting on the host, :meth:`offloading`)."""
        k = min(max(0, checkpointed_layers), self.layers)
        kept = k * self.layer_input + (self.layers - k) * self.per_layer
        return kept * (self.layers - 1) / max(1, self.layers)

    def keeping_attention(self, kept: float, attention_layers: int) -> CallBytes:
        """These figures when every checkpointed layer also keeps its attention output,
        ``kept`` bytes per token and attention layer
        (:mod:`dtree.ops.stack_attention.output_memo`): spread over the layers, a
        checkpointed layer's input grows by ``kept * attention_layers / layers``."""
        share = kept * attention_layers / max(1, self.layers)
        return replace(self, checkpointed=self.checkpointed + kept * attention_layers,
                       layer_input=self.layer_input + share)

    def offloading(self) -> CallBytes:
        """These figures when checkpointed layers keep their inputs in pinned host memory
        (:mod:`dtree.models.host_checkpoints`): a checkpointed layer keeps nothing on the
        device, and a call two layer inputs at a time in its backward (the re-run layer's and
        the one prefetched below it)."""
        resident = 2 * self.layer_input
        return replace(self, checkpointed=max(resident, self.checkpointed - self.layers * self.layer_input + resident),
                       layer_input=0.0)

    def describe(self) -> dict:
        return {"full_kb": self.full / 1e3, "checkpointed_kb": self.checkpointed / 1e3,
                "per_layer_kb": self.per_layer / 1e3, "backward_kb": self.backward(0) / 1e3,
                "backward_checkpointed_kb": self.backward(1) / 1e3, "source": self.source}


def layer_activation_bytes(spec: ModelSpec, itemsize: int) -> float:
    """Bytes HF's eager decoder layers keep for backward, per token, all layers:
    ``L * itemsize * (4 I + 6 H + 3 Hq D)`` (the MLP's four ``[T, I]`` tensors; norms'
    float32 copies and outputs, projections' inputs, attention). 2.78 MB for
    qwen2.5-1.5b in bf16, 2.73 MB measured."""
    per_layer = 4 * spec.intermediate_size + 6 * spec.hidden_size + 3 * spec.num_heads * spec.head_dim
    return spec.num_layers * itemsize * per_layer


def layer_input_bytes(spec: ModelSpec, itemsize: int) -> float:
    """Bytes per token kept with every layer checkpointed: each layer's ``[T, H]`` input,
    the final norm's and the LM head's rows."""
    return (spec.num_layers + 2) * spec.hidden_size * itemsize


def estimated_call_bytes(spec: ModelSpec, itemsize: int) -> CallBytes:
    """HF's eager layers, from the shapes (when the model cannot be probed)."""

    layer_input = spec.hidden_size * itemsize
    return CallBytes(layer_activation_bytes(spec, itemsize), layer_input_bytes(spec, itemsize), spec.num_layers,
                     layer_input, "estimated")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while the mode is active and that are still
    alive (outputs that alias an input's storage are not new). :meth:`now` counts them.
    Device-agnostic; on CUDA the allocator's own count is cheaper and is what
    :func:`measure_call_bytes` reads there."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in inputs or st.nbytes() == 0:
                continue
            known = self.live.get(ptr)
            if known is None or known[0].expired():
                self.live[ptr] = (StorageWeakRef(st), st.nbytes())
        return out

    def now(self) -> int:
        self.live = {p: e for p, e in self.live.items() if not e[0].expired()}
        return sum(n for _, n in self.live.values())


def _input_embeddings(model) -> torch.nn.Module | None:
    """The token embedding module of a model adapter (HF: ``get_input_embeddings()``)."""
    for owner in (getattr(model, "model", None), model):
        get = getattr(owner, "get_input_embeddings", None)
        if callable(get):
            emb = get()
            if isinstance(emb, torch.nn.Module):
                return emb
    return None


def _probe_stack(spec: ModelSpec, placement, tokens: int) -> StepStacks:
    device, dtype = placement
    return StepStacks(spec, tokens, 0, dtype=dtype, device=device, with_grad=False)


def _chain_attention(stack: StepStacks, tokens: int, attention: str, recurrence: str | None) -> GroupAttention:
    """The attend callable of one root chain of ``tokens`` tokens (pushing nothing)."""
    layout = SegmentLayout(q_offsets=np.array([0, tokens]), own_slot=np.array([0]), prefix_ranges=[()])
    return GroupAttention(
        stack, 0, tokens, layout, attention, push=False, grad_seed=False, state_layout=StateLayout.roots([0, tokens]),
        recurrence=recurrence or "reference",
    )


def attention_is_plain(model: TreeModule, spec: ModelSpec, placement, attention: str, recurrence: str | None = None) -> bool:
    """Whether every layer of ``model`` attends with no score options (softcap, sinks, ALiBi, a
    window): one two-token chain through it without grad, in the step's attention scope."""
    tokens = 2
    attend = _chain_attention(_probe_stack(spec, placement, tokens), tokens, attention, recurrence)
    scope = getattr(model, "dtree_scope", None)
    with scope() if scope is not None else _Null(), torch.no_grad(), torch.random.fork_rng(
        devices=[placement[0]] if placement[0].type == "cuda" else []
    ):
        ids = torch.randint(0, spec.vocab_size, (tokens,), device=placement[0])
        model.dtree_hidden_states(ids, torch.arange(tokens, device=placement[0]), attend)
    return attend.plain


def _probe_call(
    model: TreeModule, spec: ModelSpec, placement, attention: str, tokens: int, leaves: list,
    stack: StepStacks | None = None, recurrence: str | None = None,
):
    """One chain of ``tokens`` random tokens through the model, with grad: its hidden
    states. The embedding output becomes a leaf that requires grad (appended to
    ``leaves``), so a backward to it computes every activation gradient and no parameter
    gradient. ``stack``: KV stacks of at least ``tokens`` slots (None: new ones); a
    recurrent layer starts the chain from zeros with the ``recurrence`` backend."""
    device = placement[0]
    stack = stack if stack is not None else _probe_stack(spec, placement, tokens)
    attend = _chain_attention(stack, tokens, attention, recurrence)
    ids = torch.randint(0, spec.vocab_size, (tokens,), device=device)
    positions = torch.arange(tokens, device=device)
    emb = _input_embeddings(model)

    def leaf(module, args, out):
        x = out.detach().requires_grad_(True)
        leaves.append(x)
        return x

    handle = emb.register_forward_hook(leaf) if emb is not None else None
    try:
        with torch.enable_grad(), backward_once_scope():  # as a step's calls: _backward_peak runs once
            return model.dtree_hidden_states(ids, positions, attend)
    finally:
        if handle is not None:
            handle.remove()


def _backward_peak(hidden: torch.Tensor, leaf: torch.Tensor, now) -> int | None:
    """The most bytes ``now()`` reads above its value before a backward from ``hidden`` to
    ``leaf``, its incoming gradient included (a step's layers hold the hidden states' gradient
    through their backward), sampled before and after every autograd node of the graph; None where
    the model's layers cannot run a backward to one input (HF's reentrant checkpointing): the
    policy then uses its estimate of the backward."""
    base = peak = now()
    grad = torch.randn_like(hidden)
    handles = []

    def sample(*_):
        nonlocal peak
        peak = max(peak, now())

    for node in graph_nodes(hidden.grad_fn):
        handles.append(node.register_prehook(sample))
        handles.append(node.register_hook(sample))
    try:
        # plan() may run under no_grad (log-prob passes); a checkpointed layer's re-run makes
        # its graph inside the layer's backward, sampled there
        with torch.enable_grad(), rerun_graph_hooks(sample):
            torch.autograd.backward(hidden, grad, inputs=[leaf])
    except RuntimeError as error:
        if "use_reentrant" not in str(error):
            raise
        return None
    finally:
        for h in handles:
            h.remove()
    return peak - base


def _kept(
    model, spec, placement, attention, tokens: int, root: torch.nn.Module | None, recurrence: str | None = None
) -> tuple[int, int | None]:
    """(bytes a probe call of ``tokens`` holds after its forward, the most its backward
    adds above that, or None when the model has no embedding module to stop at)."""
    device = placement[0]
    ctx = checkpointed_layers(root) if root is not None else _Null()
    # the step's attention scope over forward and backward, as in the walk: layers that HF
    # gradient checkpointing re-runs inside backward must attend through the stack again
    scope = getattr(model, "dtree_scope", None)
    scope = scope() if scope is not None else _Null()
    leaves: list = []
    stack = _probe_stack(spec, placement, tokens)  # the stack is the policy's to count, not the call's
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        with scope, ctx:
            out = _probe_call(model, spec, placement, attention, tokens, leaves, stack, recurrence)
            kept = torch.cuda.memory_allocated(device) - before
            extra = _backward_peak(out, leaves[0], lambda: torch.cuda.memory_allocated(device)) if leaves else None
    else:
        with scope, LiveBytes() as live, ctx:
            out = _probe_call(model, spec, placement, attention, tokens, leaves, stack, recurrence)
            kept = live.now()
            extra = _backward_peak(out, leaves[0], live.now) if leaves else None
    del out, leaves
    return kept, extra


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_call_bytes(
    model: TreeModule, spec: ModelSpec, placement, attention: str, checkpoint_root: torch.nn.Module | None,
    recurrence: str | None = None, tokens: tuple[int, int] = PROBE_TOKENS,
) -> CallBytes:
    """Measure :class:`CallBytes` for ``model`` at ``placement`` (device, dtype) with the
    ``attention`` backend (and, for recurrent layers, the ``recurrence`` one; None:
    ``reference``); ``checkpoint_root``: the module whose decoder layers
    :func:`dtree.models.checkpointing.checkpointed_layers` wraps (None: the layers cannot be
    checkpointed, and ``checkpointed`` is the full figure). The stacks are the policy's
    to count, not the call's: a recurrent layer's probe chain starts from zeros. Each figure's
    shorter call runs twice and the second is read: the first probe of a process meets one-time
    allocations (kernel scratch, library workspaces) that counted against the short call and took
    ~4 KB per token off the slope on qwen2.5-1.5b on an H200 (56.4 against 60.5 KB in a
    checkpointed call's backward, 0 against 6.1 without checkpointing: ``benchmarks/probe_peaks.py``,
    session AL)."""
    device, dtype = placement
    t1, t2 = tokens
    if spec.max_positions is not None and t2 > spec.max_positions:
        # a probe chain past the model's positions would index its position table out of
        # bounds (GPT-J's embed_positions): measure within them, the slope is per token
        t2 = max(2, spec.max_positions)
        t1 = max(1, min(t1, t2 // 2))
    per = float(t2 - t1)

    def slopes(root):
        _kept(model, spec, placement, attention, t1, root, recurrence)  # the process's one-time allocations
        (k1, b1), (k2, b2) = (_kept(model, spec, placement, attention, t, root, recurrence) for t in (t1, t2))
        return (k2 - k1) / per, (None if b1 is None or b2 is None else max(0.0, (b2 - b1) / per))

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        full, back = slopes(None)
        ckpt, back_ckpt = slopes(checkpoint_root) if checkpoint_root is not None else (full, back)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return CallBytes(full, min(full, ckpt), spec.num_layers, spec.hidden_size * itemsize,
                     backward_full=back, backward_checkpointed=back_ckpt)
