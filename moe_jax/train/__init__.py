"""LoRA fine-tuning: configuration, data, the training loop, checkpoints."""
