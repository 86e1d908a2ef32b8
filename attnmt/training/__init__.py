"""Training: the update step, the loop, checkpoints, distributed helpers."""
