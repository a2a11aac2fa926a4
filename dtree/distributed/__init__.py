"""Data-parallel tree training: cost model, balanced partitioning, gradient sync.

    plan = plan_partition(forest, world_size, CostModel.from_spec(runtime.spec))
    local = plan.forest(rank)                      # None when this rank got nothing
    out = distributed_forward_backward(runtime, local, loss)   # exact, globally normalized

or, all in one, :class:`DistributedTreeTrainer` (plain modules, DDP or FSDP2, see
:func:`wrap_model`).
See the modules for details: :mod:`.features` and :mod:`.cost_model` (what a rank's
step costs), :mod:`.partition` and :mod:`.balance` (who gets which sequences),
:mod:`.sync` and :mod:`.trainer` (one gradient sync per step, failures on every rank),
:mod:`.wrap` (``wrap_model``: a model for plain all-reduce, DDP or FSDP2),
:mod:`dtree.bench.calibrate` (``dtree calibrate``: fit the cost model on this machine).
"""

from .balance import karmarkar_karp, lpt
from .cost_model import CostModel, FitReport
from .features import FEATURES, CostFeatures, forest_features, sequence_features
from .nnls import nnls
from .partition import Partition, PartitionReport, plan_partition
from .trainer import DistributedStepError, DistributedStepOutput, DistributedTreeTrainer, distributed_forward_backward
from .wrap import SYNCS, wrap_model

__all__ = [
    "FEATURES",
    "CostFeatures",
    "CostModel",
    "DistributedStepError",
    "DistributedStepOutput",
    "DistributedTreeTrainer",
    "FitReport",
    "SYNCS",
    "Partition",
    "PartitionReport",
    "distributed_forward_backward",
    "forest_features",
    "karmarkar_karp",
    "lpt",
    "nnls",
    "plan_partition",
    "sequence_features",
    "wrap_model",
]

