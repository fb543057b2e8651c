"""Weights cast once per optimizer step, with their gradients added into ``.grad`` in place
(``model.cast_weights_once_per_step``).

Without FSDP, the weights are fp32 and autocast computes in bf16: every micro-batch's forward
casts each weight to bf16 (a read of 4 bytes and a write of 2 per parameter), and every backward
hands autograd a bf16 weight gradient, which it casts to an fp32 copy and then adds into
``.grad`` (6 + 12 bytes per parameter). The weights do not change inside a step, so
``StepWeights`` casts each linear's weight once, before the step's first micro-batch, and every
forward uses that copy; the copy's backward (``StepCast``) adds the bf16 gradient into the fp32
``.grad`` in place (one pass: 10 bytes per parameter), as Megatron-LM's gradient-accumulation
fusion writes into its fp32 main gradients. The sums are the same numbers: the bf16 gradient is
exactly representable in fp32 and added in fp32, as autograd adds it.

For plain ``nn.Linear`` layers with fp32 weights that are whole tensors on the rank (no FSDP,
which gathers bf16 weights itself, nor TP), with gradient accumulation (with one micro-batch a
step there is nothing to reuse, and the copy would only be held longer). Costs a bf16 copy of
those weights (2 bytes per parameter) for the step. The FP8 weights of
``dtrain.parallel.fp8_step_cast`` use ``add_into_grad`` the same way.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.hooks import StepHook


def _add(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.add_(grad)


def _copy(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.copy_(grad)


# On the GPU one vectorised kernel each (eager's add of mixed dtypes is its slower unrolled
# kernel: 2.8 TB/s on an H200; shapes after the first are compiled dynamic); eager elsewhere.
_compiled = {op: torch.compile(op, fullgraph=True) for op in (_add, _copy)}


def add_into_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Adds ``grad`` (any float dtype) into ``param.grad`` in place, in ``param``'s dtype; the
    first gradient of a step becomes a new contiguous ``.grad``. The backward of a step's weight
    calls this and returns no gradient, so autograd neither casts nor accumulates a copy."""
    first = param.grad is None
    if first:
        param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
    op = _copy if first else _add
    (_compiled[op] if grad.is_cuda else op)(param.grad, grad)


class StepCast(torch.autograd.Function):
    """``weight`` in ``dtype`` as a function of ``weight`` whose gradient is added into
    ``weight.grad`` in place (``add_into_grad``) instead of returned."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight
        return weight.detach().to(dtype, copy=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        add_into_grad(ctx.weight, grad)
        return None, None


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the step's weight where there is one (training), else the
    module's own (evaluation, or before the first step)."""
    weight = self._step_weight
    if weight is None or not torch.is_grad_enabled():
        return type(self).forward(self, input)
    return F.linear(input, weight, self.bias)


def step_weight_linears(model_parts: Sequence[nn.Module]) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``model_parts`` (not torchao's FP8 subclass) whose
    weight is an fp32 tensor whole on the rank (not a DTensor) and used by that layer alone (a
    weight tied to an embedding also gets that embedding's gradient through autograd)."""
    from torch.distributed.tensor import DTensor

    uses = Counter(id(p) for part in model_parts for m in part.modules()
                   for p in m.parameters(recurse=False))
    return [m for part in model_parts for m in part.modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32
            and not isinstance(m.weight, DTensor) and uses[id(m.weight)] == 1]


class StepWeights(StepHook):
    """Casts the weights of ``linears`` to ``dtype`` before each step; every micro-batch's
    forward uses the copies and adds its weight gradients into ``.grad`` in place; the copies
    are dropped before the update (their values would be stale after it)."""

    def __init__(self, linears: Sequence[nn.Linear], dtype: torch.dtype):
        self.linears, self.dtype = list(linears), dtype
        for linear in self.linears:
            linear._step_weight = None
            linear.forward = types.MethodType(_forward, linear)

    def before_step(self) -> None:
        with torch.enable_grad():
            for linear in self.linears:
                linear._step_weight = StepCast.apply(linear.weight, self.dtype)

    def before_update(self) -> None:
        for linear in self.linears:
            linear._step_weight = None
