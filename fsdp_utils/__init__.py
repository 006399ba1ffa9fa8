"""Distribution for the training loop: process group, FSDP wrapping, optimizer, metrics, checkpoints."""
