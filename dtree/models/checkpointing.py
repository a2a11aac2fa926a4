"""Per-layer activation checkpointing of a model's decoder layers, one implementation for
dtree's runtime (``TreeRuntime(checkpoint_layers=True)``, or chosen by its memory
policy) and the baselines (``checkpoint=True``, as mask-based trainers like AReaL run).

:func:`checkpointed_layers` runs every decoder layer of the model, while the block is
active, through :func:`dtree.models.layer_recompute.recompute_in_backward`: the forward
runs with grad off and keeps only the layer's inputs (one ``[T, hidden]`` tensor per
layer: 86 KB per token for qwen2.5-1.5b in bf16, against ~2.8 MB of eager activations) and
backward re-runs the layer with grad on and back-propagates through the re-run
(``torch.utils.checkpoint``'s non-reentrant form cost ~0.75 ms more host time per layer
and step: it builds the forward's graph anyway and passes every saved tensor through
Python hooks). The re-run re-enters the attention implementation the forward used: the models'
configs are switched to dtree's attention function only during the model call, so a
plain recompute in backward would silently run the model's default attention instead.

In dtree's runtime the re-run layer calls the group's ``attend`` again: it re-pushes the
layer's K/V into the stack slots the group holds (the same values; its ancestors are
still on the stack) and takes them through ``seed_from_stack``, whose backward adds the
slots' gradients to the re-run K/V. The re-run restores the forward's random-number
states (and autocast settings), so dropout under :mod:`dtree.device.rng`'s per-group
seeds draws the same masks.

The re-run also runs in a copy of the forward's ``contextvars`` context, where the HF
adapter's active model call lives (the attention callback and its per-layer guard,
:mod:`dtree.models.guard`): without it the re-run would find no dtree call active.

With ``keep_attention_outputs`` the layer's forward records its stack attention's output
and log-sum-exp, and the re-run takes them back instead of running the attention forward
again (:mod:`dtree.ops.stack_attention.output_memo`): 3 KB more per token and layer on
qwen2.5-1.5b, one attention forward less per layer. The memory policy decides.

With ``inputs_on_host`` the layers' inputs (and the attention outputs they keep) wait in pinned
host memory from the forward to the re-run (:mod:`dtree.models.host_checkpoints`: one group per
model call, so the backward's prefetch of the layer below stays inside its call; a layer's
entries are one unit, prefetched together); the runtime does so under a memory cap.

The re-run runs in :func:`dtree.ops.rerun.rerun_scope`: ops whose output value no backward
of the layer reads may skip their work there (the lean MLP's down projection: its output
only enters the residual add, whose backward reads no values).

A model whose layers hand tensors to later layers outside their arguments (Gemma 3n's KV-shared
layers read the keys and values an earlier layer left in ``shared_kv_states``) runs under
``torch.utils.checkpoint``'s non-reentrant form instead: dtree's recompute runs a layer's forward
with grad off, so what it leaves there carries no graph, and the later layers' gradients for those
keys and values would not reach the earlier layer (:func:`_attention_configs`).

The layers are swapped for :class:`CheckpointedLayer` wrappers in their ``ModuleList``
for the duration of the block (the wrapper calls the layer itself, so a
``torch.compile``-d layer stays compiled inside the checkpoint), and restored after.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from ..ops.rerun import rerun_scope
from ..ops.stack_attention.output_memo import OutputMemo
from .host_checkpoints import HostCheckpoints
from .layer_list import LAYER_LIST_PATHS, find_decoder_layers
from .layer_recompute import inputs_on_host, recompute_in_backward

__all__ = ["CheckpointedLayer", "LayerCheckpointing", "checkpointed_layers", "decoder_layers"]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The ``ModuleList`` of ``model``'s decoder layers
    (:func:`dtree.models.layer_list.find_decoder_layers`); a ValueError naming the fix
    if there is none."""
    layers = find_decoder_layers(model)
    if layers is None:
        raise ValueError(
            f"checkpoint=True needs {type(model).__name__}'s decoder layers as a torch.nn.ModuleList attribute named "
            f"one of {LAYER_LIST_PATHS} (on the model or its base model); rename it, or run with checkpoint=False"
        )
    return layers


def _attention_configs(model: torch.nn.Module) -> tuple[list[Any], bool]:
    """Every distinct transformers config reachable from ``model``'s modules (the objects
    whose ``_attn_implementation`` picks each layer's attention function), and whether the
    layers need the forward's graph built in the forward (torch's checkpoint): HF gradient
    checkpointing is on in a module (a training one with ``gradient_checkpointing=True``), or
    a layer reads tensors an earlier layer computed outside the layers' arguments (a KV-shared
    attention layer: Gemma 3n's ``is_kv_shared_layer``, which reads the keys and values the
    last layer of its type before the sharing point stored)."""
    found: dict[int, Any] = {}
    graph_in_forward = False
    for module in model.modules():
        # instance attributes (a missing one would go through nn.Module.__getattr__'s raise)
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
        flag = module.__dict__.get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False))
        graph_in_forward = (graph_in_forward or (flag is True and module.training)
                            or module.__dict__.get("is_kv_shared_layer") is True)
    return list(found.values()), graph_in_forward


@contextlib.contextmanager
def _attention_implementations(saved: list[tuple[Any, Any]]) -> Iterator[None]:
    """Set each config's ``_attn_implementation`` to the saved value while the block runs."""
    current = [(config, config._attn_implementation) for config, _ in saved]
    try:
        for config, impl in saved:
            if config._attn_implementation != impl:
                config._attn_implementation = impl
        yield
    finally:
        for config, impl in current:
            if config._attn_implementation != impl:
                config._attn_implementation = impl


class CheckpointedLayer(torch.nn.Module):
    """``layer`` run without keeping its activations, re-run in backward
    (:func:`~dtree.models.layer_recompute.recompute_in_backward`).

    ``configs``: the transformers configs whose attention implementation must be the
    same in the backward recompute as in the forward (captured at every call).
    ``keep_attention_outputs``: the re-run takes the forward's attention outputs back
    (see the module docstring). ``torch_checkpoint``: run under non-reentrant
    ``torch.utils.checkpoint`` instead (HF gradient checkpointing is on inside the model:
    its own checkpoints re-run inside ours, which that form nests). ``host``: the
    :class:`~dtree.models.host_checkpoints.HostCheckpoints` group the layer's input waits in
    (None: on the device); :class:`LayerCheckpointing` sets one per model call.
    ``rerun_chunk_rows``: the rows per chunk of the re-run's SwiGLU backward
    (:func:`dtree.ops.rerun.rerun_chunk_rows`; 0: the whole call at once, None: the op's own).
    """

    def __init__(self, layer: torch.nn.Module, configs: list[Any], keep_attention_outputs: bool = False,
                 torch_checkpoint: bool = False, rerun_chunk_rows: int | None = None) -> None:
        super().__init__()
        self.layer = layer
        self._configs = configs
        self._keep_attention_outputs = keep_attention_outputs
        self._torch_checkpoint = torch_checkpoint
        self._rerun_chunk_rows = rerun_chunk_rows
        self.host: HostCheckpoints | None = None

    def forward(self, *args, **kwargs):
        saved = [(config, config._attn_implementation) for config in self._configs]
        context = contextvars.copy_context()  # the active dtree model call, for the recompute
        layer, rows = self.layer, self._rerun_chunk_rows
        memo = OutputMemo(self.host) if self._keep_attention_outputs else None
        runs = [0]  # the first run is the forward, every later one a re-run

        def call(*a, **kw):
            rerun = runs[0] > 0
            runs[0] += 1
            with _attention_implementations(saved), rerun_scope(rows) if rerun else contextlib.nullcontext():
                if memo is None:
                    return layer(*a, **kw)
                with memo.replaying_scope() if rerun else memo.recording():
                    return layer(*a, **kw)

        def run(*a, **kw):
            return context.run(call, *a, **kw)

        if not torch.is_grad_enabled():
            return layer(*args, **kwargs)
        if self._torch_checkpoint:
            return checkpoint(run, *args, use_reentrant=False, **kwargs)
        # None: on the device; else the input and the kept outputs share one unit (one prefetch)
        with inputs_on_host(self.host), self.host.unit() if self.host is not None else contextlib.nullcontext():
            return recompute_in_backward(run, *args, **kwargs)

    def __getattr__(self, name: str):
        # attributes a model's forward may read off its layers (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class LayerCheckpointing:
    """The checkpointed wrappers of ``model``'s decoder layers (see :func:`decoder_layers`),
    built once and swapped in per model call by :meth:`applied`: the walk makes one per
    step, where building them per call (the configs' walk over every module, a wrapper
    module per layer) cost ~2.5 ms of host time per call on an H100 host."""

    def __init__(self, model: torch.nn.Module, keep_attention_outputs: bool = False,
                 inputs_on_host: bool = False, rerun_chunk_rows: int | None = None) -> None:
        self.layers = decoder_layers(model)
        self._model, self._keep, self._on_host = model, keep_attention_outputs, inputs_on_host
        self._rows = rerun_chunk_rows
        self._wrappers: list[CheckpointedLayer] | None = None

    def _built(self) -> list[CheckpointedLayer]:
        if self._wrappers is None:
            configs, graph_in_forward = _attention_configs(self._model)
            self._wrappers = [CheckpointedLayer(layer, configs, self._keep, graph_in_forward, self._rows)
                              for layer in self.layers]
        return self._wrappers

    @contextlib.contextmanager
    def applied(self, count: int | None = None) -> Iterator[None]:
        """While the block runs, the first ``count`` layers (None: all) are checkpointed;
        nested use is a no-op (the layers are wrapped once). With ``inputs_on_host`` the
        block's checkpointed layers share one new host group (the call's)."""
        layers = self.layers
        if any(isinstance(layer, CheckpointedLayer) for layer in layers):
            yield
            return
        count = len(layers) if count is None else max(0, min(int(count), len(layers)))
        originals = list(layers)
        wrappers = self._built() if count else []
        group = HostCheckpoints() if self._on_host and count else None
        try:
            for i in range(count):
                layers[i] = wrappers[i]
                wrappers[i].host = group
            yield
        finally:
            for i in range(count):
                layers[i] = originals[i]
                wrappers[i].host = None


@contextlib.contextmanager
def checkpointed_layers(
    model: torch.nn.Module, count: int | None = None, keep_attention_outputs: bool = False,
    rerun_chunk_rows: int | None = None,
) -> Iterator[None]:
    """While the block runs, the first ``count`` decoder layers of ``model`` (see
    :func:`decoder_layers`; None: all of them) are checkpointed: their forward keeps
    only their input (and with ``keep_attention_outputs`` their stack attention's
    output), and backward recomputes them. The memory policy checkpoints part
    of the layers when all of a call's activations do not fit but some do: the peak is
    the sum over layers, so which ones does not matter, and the first ``count`` are as
    good as any. One :class:`LayerCheckpointing` for this block (a caller that swaps the
    layers per call keeps one instead).

    ``rerun_chunk_rows``: the re-runs' SwiGLU backward chunks (:class:`CheckpointedLayer`).

    Nested use is a no-op (the layers are wrapped once)."""
    with LayerCheckpointing(model, keep_attention_outputs, rerun_chunk_rows=rerun_chunk_rows).applied(count):
        yield
