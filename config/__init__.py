"""Config schema (schema.py) and YAML presets (*.yaml)."""
from .schema import (
    Config,
    ConfigError,
    check_batch_split,
    launch_problems,
    load_config,
    save_config,
    split_known_args,
    summarize_config,
)

__all__ = ["Config", "ConfigError", "check_batch_split", "launch_problems", "load_config", "save_config",
           "split_known_args",
           "summarize_config"]
