"""Building a model and making it parallel: `build_model` (ours or a Hugging Face causal LM, on the meta
device when sharded), `prepare_blocks` (FP8 conversion, activation checkpointing, compile), and the FSDP adapter
(FSDP1 or FSDP2), in the order train/build_run.py documents."""
