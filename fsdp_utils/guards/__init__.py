"""What guards a run while it runs: stop signals that save first (preemption, Ctrl-C), elastic membership changes,
and the lock that keeps two runs out of one output directory."""
