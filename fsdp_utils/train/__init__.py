"""The training loop's parts: the one training step, the optimizer and schedule, the micro-batch
search and out-of-memory retry, metrics, stop signals and the run lock."""
