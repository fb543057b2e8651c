"""The forward and backward of one optimizer step, as two implementations of one interface.

``ForwardBackward`` takes the step's micro-batches from a ``DeviceBatches`` and returns this
rank's summed token loss, with every gradient accumulated: ``Accumulation`` runs one forward and
backward per micro-batch (plain gradient accumulation); ``dtrain.parallel.pipeline.Pipeline``
runs them all through a pipeline schedule. The trainer calls whichever the run has.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from dtrain.dtensor import full
from dtrain.kernels import cross_entropy as kernels
from dtrain.models.mtp import mtp_columns


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 (labels of -100 are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=-100)


def fused_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``cross_entropy_sum`` through ``dtrain.kernels.cross_entropy``: on CUDA, one Triton pass
    over the logits forward and one backward (logits whole on the rank, not vocabulary-sharded
    DTensors)."""
    return kernels.cross_entropy_sum(logits.flatten(0, 1), labels.flatten())[0]


@dataclass
class StepResult:
    """What one optimizer step leaves for the log: device tensors, read only when logged."""
    loss_sum: torch.Tensor
    """This rank's summed token loss (``Trainer.mean_loss`` reduces it over the ranks)."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping."""
    lr: float
    """The learning rate the step used."""
    data_wait: float
    """Seconds the step waited for its micro-batches."""


def step_context(device_type: str, dtype: torch.dtype, autocast: bool,
                 sharded_loss: bool) -> Callable[[], contextlib.ExitStack]:
    """A factory of the context every forward runs in: autocast to ``dtype`` (bf16 compute on
    fp32 weights without FSDP, which casts itself) and loss parallel (vocabulary-sharded logits
    under tensor parallel), as the run needs."""

    def context() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        if sharded_loss:
            stack.enter_context(loss_parallel())
        return stack

    return context


class DeviceBatches:
    """Micro-batches of a loader on ``device``, with the columns of ``mtp_depths`` multi-token
    prediction depths (``mtp_columns``), cut to this rank's tokens when ``positions`` (context
    parallel) is given; the seconds spent waiting for them are summed until
    ``take_wait``."""

    def __init__(self, loader, device: torch.device, positions: torch.Tensor | None,
                 mtp_depths: int = 0):
        self.loader, self.device, self.positions = loader, device, positions
        self.mtp_depths = mtp_depths
        self.waited = 0.0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        inputs, labels = self.loader.next_batch()
        self.waited += time.perf_counter() - start
        inputs = inputs.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        inputs, labels = mtp_columns(inputs, labels, self.mtp_depths)
        if self.positions is None:
            return inputs, labels
        return inputs[:, self.positions], labels[:, self.positions]

    def take_wait(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited


class ForwardBackward(Protocol):
    def __call__(self, batches: DeviceBatches) -> torch.Tensor:
        """Runs the step's forwards and backwards; returns this rank's summed token loss."""


class Accumulation:
    """Gradient accumulation over ``microbatches`` micro-batches. Each loss is scaled by
    ``scale`` before its backward, so the gradients sum to those of the mean token loss of the
    global batch (FSDP then averages them over the data ranks)."""

    def __init__(self, model: nn.Module, loss_fn, microbatches: int, scale: float,
                 context: Callable[[], contextlib.ExitStack]):
        self.model, self.loss_fn, self.microbatches = model, loss_fn, microbatches
        self.scale, self.context = scale, context

    def __call__(self, batches: DeviceBatches) -> torch.Tensor:
        loss_sum = torch.zeros((), device=batches.device)
        for _ in range(self.microbatches):
            inputs, labels = batches.next()
            with self.context():
                loss = self.loss_fn(self.model(inputs), labels)
                (loss * self.scale).backward()
            loss_sum += full(loss.detach())
        return loss_sum
