"""torchao's FP8 matmul with the step's FP8 weight given twice (``dtrain.parallel.fp8_step_cast``).

``_scaled_mm`` takes its second operand column-major. The forward's weight operand (the weight
transposed) is; the input gradient's (the weight itself) is not, so torchao's backward transposes
the weight into a new copy every micro-batch (Inductor computes the feed-forward ones in the
forward and keeps them for the backward: 176 MB per Llama 3 8B block and micro-batch).
``MatmulWithStepWeight`` is torchao's ``matmul_with_hp_or_float8_args``, its forward and backward
unchanged (the same casts and products), given a column-major copy of the same bits, made once
per step, for the input gradient's product. Imports torchao (the ``fp8`` extra).
"""

from __future__ import annotations

import torch
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args


@torch._dynamo.allow_in_graph
class MatmulWithStepWeight(matmul_with_hp_or_float8_args):
    """``apply(input, weight_t, weight_t_for_grad_input, linear_mm_config, config)``: the two
    weights are FP8 tensors of the same bits and scale; the second is the one the backward's
    input-gradient product reads (column-major once transposed back) and gets no gradient."""

    @staticmethod
    def forward(ctx, input_hp, weight_t, weight_t_for_grad_input, linear_mm_config, config):
        output = matmul_with_hp_or_float8_args.forward(ctx, input_hp, weight_t,
                                                       linear_mm_config, config)
        ctx.save_for_backward(input_hp, weight_t_for_grad_input)  # in place of weight_t
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight_t, *_ = matmul_with_hp_or_float8_args.backward(ctx, grad_output)
        return grad_input, grad_weight_t, None, None, None
