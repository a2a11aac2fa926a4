"""Glue between dtree and the layouts and trainers RL code already uses.

- :mod:`dtree.integrations.padded`: padded ``[B, L]`` batches in and out (verl,
  OpenRLHF, AReaL), and TRL's separate prompt / completion tensors.
"""

from .padded import from_padded, from_prompt_completion, to_padded, to_padded_completion

__all__ = ["from_padded", "from_prompt_completion", "to_padded", "to_padded_completion"]
