"""What a checkpoint holds besides DCP's plumbing: the model's state with its modules' extra
states set apart (``fp8_meta``), each rank's random-generator states, and whether the state is
finite (a non-finite state is never written)."""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from dtrain.checkpoint_files import leaves
from dtrain.dtensor import local
from dtrain.log import logger
from dtrain.models.llama import canonical_name

EXTRA_STATE = "_extra_state"  # nn.Module's key for get_extra_state()


def model_state(model: nn.Module) -> dict[str, Any]:
    """``{"model": ...}`` without the modules' tensor extra states, and ``{"fp8_meta": ...}``
    with them as bytes where the model has any (Transformer Engine's linears)."""
    full = get_model_state_dict(model)
    extra = {k: v for k, v in full.items()
             if k.endswith(EXTRA_STATE) and isinstance(v, torch.Tensor)}
    state: dict[str, Any] = {"model": {k: v for k, v in full.items() if k not in extra}}
    if extra:
        state["fp8_meta"] = {k: io.BytesIO(v.detach().cpu().contiguous().view(torch.uint8)
                                           .numpy().tobytes()) for k, v in extra.items()}
    return state


# Transformer Engine unpickles its delayed-scaling state only when this is set (a pickle can run
# code: for checkpoints one trusts); without it a resume keeps TE's fresh scaling state.
TE_PICKLE = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def restorable_extra(state: dict[str, Any], saved: set[str],
                      model: nn.Module) -> dict[str, bytes]:
    """Takes ``fp8_meta`` out of ``state`` (as ``model_state`` made it for this model) and puts
    back only the entries the checkpoint has, to be read; returns the model's own extra states,
    which stand in for the others (a checkpoint of another backend, or of bf16). Transformer
    Engine's are read only under ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (TE refuses them
    otherwise); without it one line says that TE's scaling starts afresh."""
    own = {k: v.getvalue() for k, v in state.pop("fp8_meta", {}).items()}
    wanted = {k: io.BytesIO() for k in own if f"fp8_meta.{k}" in saved}
    te_modules = {canonical_name(name) for name, module in model.named_modules()
                  if type(module).__module__.startswith("transformer_engine")}
    te = [k for k in wanted if k.rpartition(".")[0] in te_modules]
    if te and os.environ.get(TE_PICKLE) != "1":
        logger.warning(f"checkpoint: Transformer Engine's FP8 scaling state of {len(te)} layers "
                       f"not restored (TE reads it only with {TE_PICKLE}=1, for checkpoints you "
                       "trust); their scales start afresh")
        for k in te:
            del wanted[k]
    if wanted:
        state["fp8_meta"] = wanted
    return own


def with_extra(state: dict[str, Any], own: dict[str, bytes]) -> dict[str, Any]:
    """The ``model`` entry with every extra state of the model: read from the checkpoint where
    it was, the model's own elsewhere (uint8 tensors, as Transformer Engine serialises them)."""
    read = {k: v.getvalue() for k, v in state.get("fp8_meta", {}).items()}
    extra = {k: torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
             else torch.empty(0, dtype=torch.uint8)
             for k, data in ((k, read.get(k, value)) for k, value in own.items())}
    return {**state["model"], **extra}


def rng_state() -> torch.Tensor:
    """This process's CPU generator state, followed by the current CUDA device's when there is
    one, as one byte tensor."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def set_rng_state(state: torch.Tensor) -> None:
    """Restores what ``rng_state`` returned."""
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if state.numel() > cpu and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[cpu:].clone())


def finite_state(state: dict[str, Any]) -> bool:
    """Whether every floating-point tensor (local shard) of ``state`` is finite: one reduction
    on the device per dtype, read once."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in leaves(state):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            by_device.setdefault(local(t).device, []).append(local(t))
    return all(bool(torch.stack([n.float() for n in torch._foreach_norm(ts, ord=float("inf"))])
                    .isfinite().all()) for ts in by_device.values())
