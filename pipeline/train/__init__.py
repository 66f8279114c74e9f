"""The training stage: TrainConfig, the per-worker loop, checkpoints, guards and the TorchTrainer builder."""
