"""Training programs for any plan: the SPMD training step, orbax checkpoints, multi-process start."""
