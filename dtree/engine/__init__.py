"""Running one step: the runtime, the depth-first walk, the KV and state stacks, the
attention hook, checkpointing, RNG replay and the step's finish."""
