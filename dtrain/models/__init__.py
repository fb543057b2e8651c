"""Model presets and construction: ``build("llama3_8b", device="meta")``."""

import dataclasses

import torch

from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.models.presets import PRESETS

__all__ = ["PRESETS", "LlamaArgs", "Transformer", "build", "model_args"]


def model_args(name: str, **overrides) -> LlamaArgs:
    """The preset's ``LlamaArgs`` with fields replaced by ``overrides`` (zero/None ones ignored)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset '{name}': use one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in overrides.items() if v})


def build(name: str, device: str | torch.device = "meta", seed: int | None = 0,
          **overrides) -> Transformer:
    """Builds the preset's model on ``device``. On a real device the weights are initialised
    from ``seed``; on ``meta`` they are left for ``to_empty`` + ``init_weights`` later."""
    with torch.device(device):
        model = Transformer(model_args(name, **overrides))
    if torch.device(device).type != "meta" and seed is not None:
        model.init_weights(seed)
    return model
