"""dtree: exact causal-LM training on prefix trees of token sequences.

Each unique token is computed once, depth first, with a KV-cache stack; the gradients
equal those of training every root-to-leaf sequence on its own.

    forest = dtree.Forest.from_sequences(sequences, loss_mask=masks, advantages=adv, ...)
    rt = dtree.TreeRuntime(model)
    out = rt.forward_backward(forest, dtree.losses.ppo_clip(clip_eps=0.2))
    optimizer.step()

Padded batches in and out: ``dtree.Forest.from_padded`` / ``from_prompt_completion``
and :mod:`dtree.integrations` (``to_padded``, ``to_padded_completion``). Data-parallel
training: :mod:`dtree.distributed` (``dtree.distributed.DistributedTreeTrainer``).
"""

from . import distributed, losses
from .config import RuntimeConfig
from .losses import LogprobLoss, Normalization
from .models import compile_layers
from .ops.logprobs import OutputHead
from .engine.runtime import StepOutput, TreeRuntime
from .forest.forest import Forest, ForestStats

__version__ = "0.1.0"

__all__ = [
    "Forest",
    "ForestStats",
    "LogprobLoss",
    "Normalization",
    "OutputHead",
    "RuntimeConfig",
    "StepOutput",
    "TreeRuntime",
    "compile_layers",
    "distributed",
    "losses",
    "__version__",
]
