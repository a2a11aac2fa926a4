"""The device side: the model's placement, host-to-device copies that do not stall the GPU,
and random-number state for exact replay."""
