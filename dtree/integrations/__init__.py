"""Glue between dtree and the layouts and trainers RL code already uses.

- :mod:`dtree.integrations.padded`: padded ``[B, L]`` batches in and out (verl,
  OpenRLHF, AReaL), and TRL's separate prompt / completion tensors.
- :mod:`dtree.integrations.trl` (``dtree[trl]``): ``TreeGRPOTrainer``.
- :mod:`dtree.integrations.verl` (``dtree[verl]``): the ``dtree`` engine for verl;
  :mod:`dtree.integrations.verl_losses`: verl's loss settings as dtree losses (no verl
  import). Neither trainer is imported here.
"""

from .padded import from_padded, from_prompt_completion, to_padded, to_padded_completion

__all__ = ["from_padded", "from_prompt_completion", "to_padded", "to_padded_completion"]
