"""Typed run configuration: one dataclass per TOML section (``sections``), loaded from a recipe
and CLI overrides (``load``). Each component receives only its own section (``cfg.model``,
``cfg.optimizer``, ...)."""

from dtrain.config.fields import ConfigError
from dtrain.config.load import (
    SECTIONS,
    check_ranges,
    field_docs,
    find_recipe,
    help_text,
    load_config,
)
from dtrain.config.model import ModelConfig
from dtrain.config.sections import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    Config,
    DataConfig,
    FP8Config,
    JobConfig,
    LRScheduleConfig,
    MetricsConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainingConfig,
    ValidationConfig,
)

__all__ = [
    "SECTIONS", "ActivationCheckpointConfig", "CheckpointConfig", "CompileConfig", "Config",
    "ConfigError", "DataConfig", "FP8Config", "JobConfig", "LRScheduleConfig", "MetricsConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainingConfig", "ValidationConfig",
    "check_ranges", "field_docs", "find_recipe", "help_text", "load_config",
]
