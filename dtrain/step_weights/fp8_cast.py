"""FP8 weights cast once per optimizer step (``fp8.cast_weights_once_per_step``).

torchao's ``Float8Linear`` casts its weight to FP8 in every forward, and again for the input
gradient in every backward: under gradient accumulation, twice per micro-batch, each cast a read
of the fp32 weight for its absolute maximum and another for the cast. The weights do not change
inside a step, so ``StepWeightCast`` casts each one once, before the step's first micro-batch,
and every forward and backward of the step uses that FP8 weight (torchao's matmul takes an
already-cast weight as it is), the backward's input-gradient product a column-major copy of the
same bits, also made once (``_scaled_mm`` wants its second operand column-major; torchao's
backward would transpose the weight into a new copy every micro-batch: ``fp8_matmul``).
The cast's backward adds the weight gradient (bf16 under autocast) into the fp32 ``.grad`` in
place (``add_into_grad``: one pass, where autograd would cast it to an fp32 copy and add that);
with one micro-batch a step, the product writes the fp32 gradient itself, which becomes ``.grad``
(no pass at all; the product kept in fp32, not rounded to bf16 first). The FP8 bits and scale
are torchao's own cast's (tensorwise scaling), and the gradients sum to the same numbers (with one
micro-batch, the same product unrounded).

For torchao tensorwise on weights that are whole tensors on each rank (one GPU, data parallel
without FSDP, pipeline stages, where the gradient goes through autograd); under FSDP with FP8
all-gather the weights arrive cast already.
Costs the two FP8 copies of the converted weights (2 bytes per parameter) for the step; the
per-micro-batch transposes it saves were held from each forward to its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dtrain.hooks import step_grad
from dtrain.kernels.lazy_compile import compile_on_first_call
from dtrain.step_weights.copies import StepCopies


def _forward(self, input: torch.Tensor) -> torch.Tensor:
    """``Float8Linear.forward`` with the step's FP8 weight where there is one (training), else
    torchao's own (evaluation, or before the first step)."""
    if self._step is None or not torch.is_grad_enabled():
        return type(self).forward(self, input)
    if torch.is_autocast_enabled():  # as torchao's forward: the input in the autocast dtype
        input = input.to(torch.get_autocast_dtype("cuda"))
    from dtrain.step_weights.fp8_matmul import MatmulWithStepWeight

    *weights, tune = self._step
    output = MatmulWithStepWeight.apply(input, *weights, self.linear_mm_config, self.config,
                                        tune)
    if self.bias is not None:
        output = output + self.bias.to(output.dtype)
    return output


def _scale_and_cast(weight: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's tensorwise scale of ``weight`` and its FP8 bits (``tensor_to_scale``, then
    ``hp_tensor_and_scale_to_float8``'s arithmetic: scale in fp32, saturate, convert), row-major
    and a column-major copy."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(weight, dtype,
                            round_scales_to_power_of_2=round_scales_to_power_of_2)
    bits = to_fp8_saturated(weight.to(torch.float32) * scale, dtype)
    return bits, bits.t().contiguous().t(), scale


# On the GPU a reduction and tiled pointwise kernels per weight (eager's copy of FP8 into a
# transposed layout is its unvectorised kernel: 0.18 ms for a 4096 x 14336 weight on an H200);
# eager kernels elsewhere.
_compiled_scale_and_cast = compile_on_first_call(_scale_and_cast, fullgraph=True,
                                                dynamic=False)


def _add(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.add_(grad)


def _copy(total: torch.Tensor, grad: torch.Tensor) -> None:
    total.copy_(grad)


# On the GPU one vectorised kernel each (eager's add of mixed dtypes is its slower unrolled
# kernel: 2.8 TB/s on an H200; shapes after the first are compiled dynamic); eager elsewhere.
_compiled = {op: compile_on_first_call(op, fullgraph=True) for op in (_add, _copy)}


def add_into_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Adds ``grad`` (any float dtype) into ``param.grad`` in place, in ``param``'s dtype; the
    first gradient of a step becomes a new contiguous ``.grad``. The backward of a step's weight
    calls this and returns no gradient, so autograd neither casts nor accumulates a copy."""
    first = param.grad is None
    if first:
        param.grad = torch.empty_like(param, memory_format=torch.contiguous_format)
    op = _copy if first else _add
    (_compiled[op] if grad.is_cuda else op)(param.grad, grad)


class _Cast(torch.autograd.Function):
    """The FP8 weight as a function of the weight whose gradient is added into ``weight.grad``
    in place (or, without ``into_grad``, returned to autograd). Its high-precision ``dtype`` is
    that of the gradient the backward gives it (the FP8 products' output dtype comes from the
    other operand): the compute dtype, or fp32, whose first gradient of a step becomes
    ``.grad`` as it is."""

    @staticmethod
    def forward(ctx, weight, bits, scale, linear_mm_config, dtype, into_grad):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        ctx.weight, ctx.into_grad = weight, into_grad
        return Float8TrainingTensor(bits, scale, dtype, linear_mm_config=linear_mm_config,
                                    gemm_input_role=GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.into_grad:
            return grad, None, None, None, None, None
        weight = ctx.weight
        if (weight.grad is None and grad.dtype == weight.dtype and grad.is_contiguous()
                and grad.shape == weight.shape):
            weight.grad = grad  # the product's own output: no copy
        else:
            add_into_grad(weight, grad)
        return None, None, None, None, None, None


def cast_weight_t(linear: nn.Module, dtype: torch.dtype | None = None, into_grad: bool = False,
                  grad_fp32: bool = False, accumulate: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The transposed FP8 weight of a torchao ``Float8Linear``, the bits and scale its forward
    would cast (tensorwise), the same bits column-major for the input gradient's product (no
    gradient through that one), and the fp32 ``.grad`` the product adds into, or None. The
    first's gradient goes into ``linear.weight.grad`` in place with ``into_grad``, else through
    autograd. ``dtype``: the compute dtype (default the weight's); ``grad_fp32``: the weight
    gradient's product writes fp32 (``fp8_matmul``: for a step of one micro-batch, whose
    gradient becomes ``.grad`` as it is); ``accumulate``: the product adds into
    ``linear.weight.grad`` (made zero where there is none: ``step_grad``; None where the weight
    is frozen) inside the GEMM, and the FP8 weight gets no gradient through autograd
    (``fp8_matmul``). A frozen weight gets no gradient either way."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    cast = linear.config.cast_config_weight
    scale_and_cast = _compiled_scale_and_cast if linear.weight.is_cuda else _scale_and_cast
    dtype = dtype or linear.weight.dtype
    with torch.no_grad():
        bits, column_major_bits, scale = scale_and_cast(
            linear.weight, cast.target_dtype, linear.config.round_scales_to_power_of_2)
        column_major, weight = (
            Float8TrainingTensor(b, scale, dtype, linear_mm_config=linear.linear_mm_config,
                                 gemm_input_role=GemmInputRole.WEIGHT)
            for b in (column_major_bits, bits))
    if accumulate:
        return weight.t(), column_major.t(), step_grad(linear.weight)
    weight = _Cast.apply(linear.weight, bits, scale, linear.linear_mm_config,
                         torch.float32 if grad_fp32 else dtype, into_grad)
    return weight.t(), column_major.t(), None


def step_cast_linears(model_parts: Sequence[nn.Module]) -> list[nn.Module]:
    """The torchao ``Float8Linear`` layers of ``model_parts`` whose weight is a whole tensor
    (not a DTensor shard) with tensorwise scaling: those ``StepWeightCast`` can serve."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    return [m for part in model_parts for m in part.modules()
            if isinstance(m, Float8Linear) and not isinstance(m.weight, DTensor)
            and m.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
            and m.config.cast_config_weight_for_grad_input.scaling_granularity
            is ScalingGranularity.TENSORWISE]


class StepWeightCast(StepCopies):
    """Casts the FP8 weights of ``linears`` before each step; the step's forwards and backwards
    use them; they are dropped before the update (their values would be stale after it).
    ``dtype``: the compute dtype; ``into_grad``: each backward adds its weight gradient into
    ``.grad`` in place (not under a pipeline schedule, whose split backwards find the weights'
    gradients through autograd); ``one_micro_batch``: the step has one, whose weight gradients
    the products write in fp32 as the ``.grad``; with several, each product adds into a zeroed
    fp32 ``.grad`` (``accumulate``), both where ``into_grad`` and all the layers' casts allow
    (``fp8_matmul``); ``units``: see ``StepCopies``; ``tune``: those GEMMs that add into
    ``.grad`` run cuBLASLt's fastest algorithm for their shapes
    (``dtrain.kernels.cublaslt_binding``)."""

    def __init__(self, linears: Sequence[nn.Module], dtype: torch.dtype, into_grad: bool,
                 units: Sequence[nn.Module] = (), one_micro_batch: bool = False,
                 tune: bool = False):
        from dtrain.step_weights.fp8_matmul import own_weight_grad_product_supported

        self.dtype, self.into_grad, self.tune = dtype, into_grad, tune
        own_product = into_grad and all(own_weight_grad_product_supported(m.config)
                                        for m in linears)
        self.grad_fp32 = own_product and one_micro_batch
        self.accumulate = own_product and not one_micro_batch
        super().__init__(linears, _forward, units)

    def cast(self, linears: Sequence[nn.Module]) -> None:
        with torch.enable_grad():
            for linear in linears:
                linear._step = (*cast_weight_t(linear, self.dtype, self.into_grad,
                                               self.grad_fp32, self.accumulate), self.tune)

    def describe(self) -> str:
        tuned = (" (cuBLASLt's fastest algorithms, timed at the first step)"
                 if self.tune and self.layers[0].weight.is_cuda else "")
        grads = (f"added into fp32 .grad in the GEMM{tuned}" if self.accumulate
                 else "written in fp32 as .grad" if self.grad_fp32
                 else "added into .grad in place" if self.into_grad else "through autograd")
        return (f"{len(self.layers)} FP8 linears cast once per step, their weight gradients "
                f"{grads}")
