"""Building a model and making it parallel: `build_model` (ours or a Hugging Face causal LM, on the meta
device when sharded) and `parallelize` (FP8 conversion, activation checkpointing, compile, FSDP1 or
FSDP2, weight materialisation), in that documented order."""
