"""Training: the parallel trainer, its data, checkpoints and the single-device reference loop."""
