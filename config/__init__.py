"""The typed config tree: its sections (sections.py), reading and writing it (loading.py), its value and launch
checks (checks.py); and the YAML presets (*.yaml)."""
from .checks import check_batch_split, config_warnings, launch_problems, output_dir_problems
from .errors import ConfigError
from .loading import load_config, read_yaml_file, save_config, split_known_args, summarize_config
from .sections import (
    CheckpointConfig,
    Config,
    DataConfig,
    FSDPConfig,
    LoggingConfig,
    LoRAConfig,
    ModelSection,
    RunConfig,
    SourceConfig,
    TrainConfig,
)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "FSDPConfig", "LoRAConfig", "LoggingConfig",
           "ModelSection", "RunConfig", "SourceConfig", "TrainConfig", "check_batch_split", "config_warnings",
           "launch_problems",
           "load_config", "output_dir_problems", "read_yaml_file", "save_config", "split_known_args",
           "summarize_config"]
