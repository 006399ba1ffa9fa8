"""What watches a run from outside its step: the metrics log and the experiment trackers, step profiles and CUDA
memory snapshots, the GPUs' peak FLOP/s for MFU."""
