"""The training loop's parts: the one training step, the optimizer and schedule, the batches and their split, the
one function that builds a run, the micro-batch search and the out-of-memory guard over the GPU's memory readings,
the data a run trains on, the launch's checks before any process group, and where a run starts (resume)."""
