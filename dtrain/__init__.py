"""dtrain: PyTorch-native LLM training with Megatron-class parallelism.

    from dtrain import load_config, Trainer
    Trainer(load_config("debug", ["training.steps=20"])).train()
"""

from dtrain.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "Trainer", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use so that `python -m dtrain.train` and `import dtrain.config` do not
    # load the trainer (and torch.distributed) up front.
    if name == "Trainer":
        from dtrain.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'dtrain' has no attribute {name!r}")
