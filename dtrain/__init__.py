"""dtrain: PyTorch-native LLM training with Megatron-class parallelism.

    from dtrain import load_config, Trainer
    Trainer(load_config("debug", ["training.steps=20"])).train()
"""

from dtrain.config import Config, ConfigError, load_config
from dtrain.train import Trainer

__all__ = ["Config", "ConfigError", "Trainer", "load_config"]
__version__ = "0.1.0"
