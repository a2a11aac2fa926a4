"""Prepare a model for :class:`~dtree.distributed.DistributedTreeTrainer` by sync strategy.

    model = wrap_model(model, "fsdp2", group)    # or "allreduce", "ddp"
    trainer = DistributedTreeTrainer(model, process_group=group)

* ``"allreduce"``: the module as is; the trainer all-reduces its gradients once per step.
* ``"ddp"``: ``DistributedDataParallel`` over ``group`` (its reducer stays idle: the
  walk runs under ``no_sync``, then one all-reduce; :mod:`dtree.distributed.sync`).
* ``"fsdp2"``: ``fully_shard`` on every decoder layer, then on the model, over a
  one-dimensional mesh of ``group``: one FSDP parameter group per layer, as torchtitan
  shards a decoder.

Without an initialized process group, or in a group of one, every strategy returns
the module unchanged (there is nothing to synchronize).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.checkpointing import decoder_layers

__all__ = ["SYNCS", "wrap_model"]

SYNCS = ("allreduce", "ddp", "fsdp2")


def wrap_model(model: torch.nn.Module, sync: str = "allreduce", group=None) -> torch.nn.Module:
    """``model`` wrapped for ``sync`` over ``group`` (default: the world); see the module docstring.

    ``fsdp2`` shards ``model`` in place (its parameters become DTensor shards) and
    returns it; ``ddp`` returns the wrapper (train ``wrapper.module``'s parameters).

    Raises:
        ValueError: an unknown ``sync``, or ``fsdp2`` on a model without a decoder-layer
            list (``.layers``, ``.h``, ``.blocks`` on the model or its base model).
    """
    if sync not in SYNCS:
        raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
    if sync == "allreduce" or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return model
    device = next(model.parameters()).device
    if sync == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, process_group=group
        )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    try:
        layers = decoder_layers(model)
    except ValueError:
        raise ValueError(
            f"sync='fsdp2' shards each decoder layer: {type(model).__name__} needs them as a ModuleList named "
            "layers, h or blocks (on the model or its base model); call fully_shard yourself otherwise"
        ) from None
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
