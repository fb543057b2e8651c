"""torchao's FP8 matmul with the step's FP8 weight given twice (``dtrain.step_weights.fp8_cast``).

``_scaled_mm`` takes its second operand column-major. The forward's weight operand (the weight
transposed) is; the input gradient's (the weight itself) is not, so torchao's backward transposes
the weight into a new copy every micro-batch (Inductor computes the feed-forward ones in the
forward and keeps them for the backward: 176 MB per Llama 3 8B block and micro-batch).
``MatmulWithStepWeight`` is torchao's ``matmul_with_hp_or_float8_args``, its forward and backward
unchanged (the same casts and products), given a column-major copy of the same bits, made once
per step, for the input gradient's product.

The weight gradient's product writes the dtype autograd wants for the weight (the FP8 weight's
high-precision dtype): the compute dtype as torchao does, or fp32 where the step's only
micro-batch's gradient becomes the fp32 ``.grad`` as it is (torchao's product writes the compute
dtype, which autograd would then cast to an fp32 copy). The same FP8 operands, the same scales;
the product is kept in fp32 rather than rounded to bf16. With several micro-batches a step, the
product is added into the fp32 ``.grad`` inside the GEMM (``dtrain.kernels.cublaslt``: cuBLASLt
with beta = 1, the sum in fp32 in its epilogue, as Transformer Engine's weight-gradient GEMM adds
into Megatron's main gradients), where torchao's product would be written in bf16 and a second
pass would add it (10 bytes per parameter a micro-batch; on the CPU, which has no FP8 GEMM,
torchao's emulated product is added, the numbers torchao's path gives). Imports torchao (the
``fp8`` extra).
"""

from __future__ import annotations

import torch
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole


def _tensorwise(*casts) -> bool:
    return all(c.scaling_type is ScalingType.DYNAMIC
               and c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def own_weight_grad_product_supported(config) -> bool:
    """This module's own weight-gradient product (in fp32, or added into ``.grad``) serves
    torchao configs whose gradient and input casts are dynamic tensorwise, the gradient cast
    the same for both products (one cast serves both, as Inductor's common-subexpression pass
    makes of torchao's two)."""
    return (_tensorwise(config.cast_config_grad_output, config.cast_config_input_for_grad_weight)
            and config.cast_config_grad_output == config.cast_config_grad_output_for_grad_weight)


def _as(tensor: Float8TrainingTensor, dtype: torch.dtype) -> Float8TrainingTensor:
    """The same FP8 bits and scale, products with them as first operand written in ``dtype``."""
    return Float8TrainingTensor(tensor._data, tensor._scale, dtype,
                                linear_mm_config=tensor._linear_mm_config,
                                gemm_input_role=tensor._gemm_input_role)


def accumulates_in_the_gemm(grad: torch.Tensor, config) -> bool:
    """Whether the weight gradient's FP8 product adds into ``grad`` inside a real FP8 GEMM (a
    CUDA gradient, and FP8 not emulated: ``fp8.emulate`` computes every product in high
    precision, this one included, so that it runs on GPUs without FP8 too)."""
    return grad.is_cuda and not config.emulate


def _accumulate_grad_weight(grad: torch.Tensor, grad_fp8: Float8TrainingTensor,
                           input_fp8: Float8TrainingTensor, config, tune: bool) -> None:
    """``grad += grad_fp8.t() @ input_fp8`` in place: the weight gradient's product of the FP8
    gradient and input, added into the weight's fp32 ``.grad`` (on the GPU in the GEMM, with
    cuBLASLt's fastest algorithm for its shapes where ``tune``)."""
    if not accumulates_in_the_gemm(grad, config):
        # torchao's product (emulated on the CPU or under fp8.emulate; bf16 under autocast),
        # then the add
        grad.add_(torch.mm(grad_fp8.t(), input_fp8))
        return
    from dtrain.kernels.cublaslt import accumulate_scaled_mm

    # _scaled_mm's layouts, as torchao's product makes them: the first operand row-major, the
    # second column-major; the scales' inverses turn the FP8 values back into real ones.
    accumulate_scaled_mm(grad, grad_fp8._data.t().contiguous(),
                         input_fp8._data.t().contiguous().t(), grad_fp8._scale.reciprocal(),
                         input_fp8._scale.reciprocal(),
                         config.gemm_config_grad_weight.use_fast_accum, tune)


@torch._dynamo.allow_in_graph
class MatmulWithStepWeight(matmul_with_hp_or_float8_args):
    """``apply(input, weight_t, weight_t_for_grad_input, grad, linear_mm_config, config,
    tune)``: the two weights are FP8 tensors of the same bits and scale; the second is the one
    the backward's input-gradient product reads (column-major once transposed back) and gets no
    gradient. The weight gradient comes in ``weight_t``'s dtype (fp32: see the module's
    docstring), or, given ``grad`` (the weight's fp32 ``.grad``), is added into it in place
    (``tune``: by cuBLASLt's fastest algorithm for its shapes) and ``weight_t`` gets none."""

    @staticmethod
    def forward(ctx, input_hp, weight_t, weight_t_for_grad_input, grad, linear_mm_config,
                config, tune=False):
        output = matmul_with_hp_or_float8_args.forward(ctx, input_hp, weight_t,
                                                       linear_mm_config, config)
        # in place of weight_t (torchao's backward reads these two)
        ctx.save_for_backward(input_hp, weight_t_for_grad_input,
                              *(() if grad is None else (grad,)))
        ctx.grad_weight_fp32, ctx.accumulate = weight_t.dtype == torch.float32, grad is not None
        ctx.tune = tune
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if not (ctx.accumulate or ctx.grad_weight_fp32):
            grad_input, grad_weight_t, *_ = matmul_with_hp_or_float8_args.backward(ctx,
                                                                                   grad_output)
            return grad_input, grad_weight_t, None, None, None, None, None
        input_hp, weight_t, *grad = ctx.saved_tensors
        config, mm_config = ctx.config, ctx.linear_mm_config
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_fp8, input_fp8 = (
            hp_tensor_to_float8_dynamic(tensor, cast.target_dtype, mm_config, gemm_input_role=role,
                                        round_scales_to_power_of_2=config.round_scales_to_power_of_2)
            for tensor, cast, role in (
                (rows, config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT),
                (input_hp.reshape(-1, input_hp.shape[-1]), config.cast_config_input_for_grad_weight,
                 GemmInputRole.INPUT)))
        grad_input = torch.mm(grad_fp8, weight_t.t()).reshape(*grad_output.shape[:-1], -1)
        if ctx.accumulate:
            _accumulate_grad_weight(grad[0], grad_fp8, input_fp8, config, ctx.tune)
            return grad_input, None, None, None, None, None, None
        with torch.autocast(rows.device.type, enabled=False):  # the backward may run under it
            grad_weight = torch.mm(_as(grad_fp8, torch.float32).t(), input_fp8)
        return grad_input, grad_weight.t(), None, None, None, None, None
