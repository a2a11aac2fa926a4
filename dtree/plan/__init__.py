"""Planning one step before it runs: the schedule of model calls, the memory policy and its
byte model, the probe of a call's bytes, the recurrent states' slots, and the StepPlan."""
