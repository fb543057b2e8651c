"""The MoE experts' weights cast once per optimizer step (``model.moe_cast_weights_once_per_step``).

Each forward of ``GroupedExperts`` casts its three stacked weights for the grouped GEMMs (to the
compute dtype, or to FP8 with rowwise scales) and its backward hands autograd each weight's
gradient in the compute dtype, which autograd casts to an fp32 copy and adds into ``.grad``. The
weights do not change inside a step, so ``StepExpertWeights`` casts them once before the step
(one compiled kernel an operand on the GPU) and overrides the experts' one seam,
``GroupedExperts.weight_operands``, to hand every micro-batch those operands and the weight's
fp32 ``.grad``, which each backward adds into in place (one pass, no fp32 copy). A frozen
weight (``requires_grad`` False, read at each step) gets no gradient and no product.

For grouped-GEMM experts whose weights are whole tensors on the rank (no FSDP, TP nor EP, whose
gradients are reduced by FSDP's hooks) and not under a pipeline, whose schedules run the
micro-batches' backwards apart. Costs one copy of those weights in the compute dtype for the
step (bf16: 2 bytes a parameter, FP8: 2 x 1 byte).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain.hooks import step_grad
from dtrain.step_weights.copies import StepCopies


def _weight_operands(self, dtype: torch.dtype) -> list:
    """``GroupedExperts.weight_operands`` with the step's operands and gradients where there
    are (training), else the module's own (evaluation, or before the first step)."""
    if self._step is None or not torch.is_grad_enabled():
        return type(self).weight_operands(self, dtype)
    return self._step


class StepExpertWeights(StepCopies):
    """Casts the stacked weights of ``experts`` (``GroupedExperts`` whose grouped GEMMs run,
    weights whole on the rank) to ``dtype`` (or FP8) before each step and gives each weight a
    zero gradient (none where frozen: ``step_grad``) that the backwards add into in place; the
    casts are dropped before the update. ``units``: see ``StepCopies``."""

    seam = "weight_operands"

    def __init__(self, experts: Sequence[nn.Module], dtype: torch.dtype,
                 units: Sequence[nn.Module] = ()):
        self.dtype = dtype
        super().__init__(experts, _weight_operands, units)

    def cast(self, experts: Sequence[nn.Module]) -> None:
        for module in experts:
            weights = (module.w1, module.w2, module.w3)
            module._step = [(operands, step_grad(weight)) for operands, weight
                            in zip(module.cast_weights(self.dtype), weights, strict=True)]

    def describe(self) -> str:
        kind = "FP8" if self.layers[0].fp8 else str(self.dtype).removeprefix("torch.")
        return (f"the experts of {len(self.layers)} MoE layers cast to {kind} once per step, "
                f"their gradients added into fp32 .grad in place")
