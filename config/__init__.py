"""The typed config tree: its sections (sections.py), reading and writing it (loading.py), its value checks
(checks.py, the model's dimensions in model_checks.py) and its checks against the launch (launch.py); and the YAML
presets (*.yaml)."""
from data.settings import DataConfig, SourceConfig

from .checks import config_warnings
from .errors import ConfigError
from .launch import check_batch_split, fitting_world_sizes, launch_problems, output_dir_problems, unfit_world
from .loading import load_config, read_yaml_file, save_config, split_known_args, summarize_config
from .sections import (
    CheckpointConfig,
    Config,
    FSDPConfig,
    LoggingConfig,
    LoRAConfig,
    ModelSection,
    RunConfig,
    TrainConfig,
)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "FSDPConfig", "LoRAConfig", "LoggingConfig",
           "ModelSection", "RunConfig", "SourceConfig", "TrainConfig", "check_batch_split", "config_warnings",
           "fitting_world_sizes", "launch_problems", "load_config", "output_dir_problems", "read_yaml_file",
           "save_config", "split_known_args", "summarize_config", "unfit_world"]
