"""Weights cast once per optimizer step, their gradients added into fp32 ``.grad`` in place: one
component, which decides for itself which of its variants apply to a run.

Without FSDP the weights are fp32 and the step computes in bf16 (or FP8): every micro-batch's
forward casts each weight again, and every backward hands autograd a low-precision weight
gradient that autograd casts to an fp32 copy and then adds into ``.grad``. The weights do not
change inside a step, so each variant casts its layers' weights once, before the step's first
micro-batch (or, under the overlapped step without FSDP, before each unit's first forward), and
its backwards add into the fp32 ``.grad`` in place, on a GPU inside the weight-gradient GEMM
(Megatron-LM's gradient-accumulation fusion):

==================  ====================================  ===============================
variant             layers                                module
==================  ====================================  ===============================
bf16 linears        ``nn.Linear``, fp32 weights           ``linears.StepLinearWeights``
embedding rows      ``nn.Embedding``                      ``linears.StepEmbeddingGrads``
experts             ``GroupedExperts`` (grouped GEMMs)    ``experts.StepExpertWeights``
FP8 linears         torchao ``Float8Linear`` tensorwise   ``fp8_cast.StepWeightCast``
==================  ====================================  ===============================

Each is a ``copies.StepCopies`` step hook: it keeps its layers' step copies in one slot,
``layer._step`` (None outside a step), read by the one method of the layer it overrides on the
instance (``forward``; the experts' seam ``GroupedExperts.weight_operands``). The GEMMs that add
into fp32 are GPU primitives in ``dtrain.kernels`` (``accumulate``: bf16; ``cublaslt``: FP8).
A weight frozen at a step (``requires_grad`` False, read at each step: ``hooks.step_grad``)
gets no ``.grad``. Transformer Engine's linears keep their own step cast (the first
micro-batch flag, from ``dtrain.parallel.fp8``).

``step_weight_hooks(model_parts, plan)`` returns the hooks that apply, from ``StepPlan``: what
the run's layout decides (compute dtype, micro-batches, whole weights or not, pipeline,
overlap units) and the three settings that turn the variants off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from dtrain.models.moe import GroupedExperts
from dtrain.step_weights.copies import StepCopies
from dtrain.step_weights.experts import StepExpertWeights
from dtrain.step_weights.linears import (
    StepEmbeddingGrads,
    StepLinearWeights,
    step_grad_embeddings,
    step_weight_linears,
)

__all__ = ["StepPlan", "step_weight_hooks"]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What decides which step-weight variants apply to a run.

    ``compute_dtype``: the step's; ``micro_batches``: per step (with one, a bf16 copy would
    only be held longer; the FP8 products then write ``.grad`` in fp32); ``autocast``: autocast
    computes on fp32 weights (without FSDP, which casts them itself); ``whole_weights``: no
    FSDP, TP nor EP (the experts' weights are whole on the rank); ``pipeline``: a pipeline
    schedule runs the micro-batches' backwards apart (their weight gradients go through
    autograd); ``units``: the overlapped step's units without FSDP, whose casts wait for each
    unit's update; ``linears``, ``experts``, ``fp8``: ``model.cast_weights_once_per_step``,
    ``model.moe_cast_weights_once_per_step`` and torchao's ``fp8.cast_weights_once_per_step``;
    ``tune``: the dense layers' GEMMs that add into ``.grad`` (shapes that repeat every
    micro-batch) run cuBLASLt's fastest algorithm for their shapes, timed at their first call
    (``compile.tune_gemms``, not with ``training.deterministic``)."""

    compute_dtype: torch.dtype
    micro_batches: int
    autocast: bool
    whole_weights: bool
    pipeline: bool
    units: Sequence[nn.Module] = ()
    linears: bool = True
    experts: bool = True
    fp8: bool = False
    tune: bool = False


def step_weight_hooks(model_parts: Sequence[nn.Module], plan: StepPlan) -> list[StepCopies]:
    """The step hooks of the variants that apply to ``model_parts`` under ``plan``."""
    hooks: list[StepCopies] = []
    if plan.fp8:
        from dtrain.step_weights.fp8_cast import StepWeightCast, step_cast_linears

        if linears := step_cast_linears(model_parts):
            hooks.append(StepWeightCast(linears, plan.compute_dtype, into_grad=not plan.pipeline,
                                        units=plan.units, one_micro_batch=plan.micro_batches == 1,
                                        tune=plan.tune))
    if plan.linears and plan.micro_batches > 1 and plan.autocast and not plan.pipeline:
        if linears := step_weight_linears(model_parts):
            hooks.append(StepLinearWeights(linears, plan.compute_dtype, plan.units, plan.tune))
        if tables := step_grad_embeddings(model_parts):
            hooks.append(StepEmbeddingGrads(tables, plan.units))
    if plan.experts and plan.whole_weights and not plan.pipeline:
        if experts := grouped_experts(model_parts, plan.compute_dtype):
            hooks.append(StepExpertWeights(experts, plan.compute_dtype, plan.units))
    return hooks


def grouped_experts(model_parts: Sequence[nn.Module], dtype: torch.dtype) -> list[nn.Module]:
    """The ``GroupedExperts`` of ``model_parts`` whose forward in ``dtype`` runs grouped GEMMs."""
    experts = [m for part in model_parts for m in part.modules() if isinstance(m, GroupedExperts)]
    return [m for m in experts
            if m.grouped(torch.empty(0, device=m.w1.device, dtype=dtype))]
