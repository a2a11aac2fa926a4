"""What a step holds on the device between calls: the KV stack, the recurrent-state stack,
StepStacks (one per attention shape), and the attention hook that writes and reads them."""
