"""What the compiler and autograd see of the context-parallel operators: fake implementations
(shapes and strides for tracing), the autograd formulas that call each backward operator, and
the operator of each comm type."""

from __future__ import annotations

from functools import partial

import torch

from dtrain.parallel.context.all_gather import all_gather_attention, all_gather_attention_backward
from dtrain.parallel.context.blocks import math_dtype, shards_of
from dtrain.parallel.context.ring import ring_attention, ring_attention_backward
from dtrain.parallel.context.ulysses import a2a_attention, a2a_attention_backward


def _fake_out(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=math_dtype(q)))


def _fake_grads(*tensors: torch.Tensor):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


ring_attention.register_fake(lambda q, k, v, group, kernel: _fake_out(q))
all_gather_attention.register_fake(lambda q, k, v, group, kernel: _fake_out(q))


@a2a_attention.register_fake
def _(q, k, v, group, kernel):
    n = shards_of(group).size
    b, s, h, d = q.shape
    hk = k.shape[2]
    empty = partial(q.new_empty, dtype=q.dtype)
    return (empty((b, s, h, d)), empty((b, s * n, h // n, d)), empty((b, s * n, hk // n, d)),
            empty((b, s * n, hk // n, d)), empty((b, s * n, h // n, d)),
            q.new_empty((b, h // n, s * n), dtype=math_dtype(q)))


for _backward_op in (ring_attention_backward, all_gather_attention_backward):
    _backward_op.register_fake(lambda dout, q, k, v, out, lse, group, kernel:
                               _fake_grads(q, k, v))


@a2a_attention_backward.register_fake
def _(dout, qh, kh, vh, out_h, lse_h, group, kernel):
    n = shards_of(group).size
    b, s, h, d = dout.shape
    hk = kh.shape[2] * n
    empty = partial(dout.new_empty, dtype=dout.dtype)
    return empty((b, s, h, d)), empty((b, s, hk, d)), empty((b, s, hk, d))


def _save_inputs_and_outputs(ctx, inputs, output) -> None:
    q, k, v, group, kernel = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group, ctx.kernel = group, kernel


def _save_head_split(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.group, ctx.kernel = inputs[3], inputs[4]


def _backward_with(op):
    def backward(ctx, dout, *unused):
        return (*op(dout.contiguous(), *ctx.saved_tensors, ctx.group, ctx.kernel), None, None)
    return backward


ring_attention.register_autograd(_backward_with(torch.ops.dtrain.cp_ring_attention_backward),
                                  setup_context=_save_inputs_and_outputs)
all_gather_attention.register_autograd(
    _backward_with(torch.ops.dtrain.cp_all_gather_attention_backward),
    setup_context=_save_inputs_and_outputs)
a2a_attention.register_autograd(_backward_with(torch.ops.dtrain.cp_a2a_attention_backward),
                                 setup_context=_save_head_split)

# The operator of each comm type; selective activation checkpointing keeps their outputs
# (dtrain.parallel.activation_checkpoint).
CP_OPS = {"p2p": torch.ops.dtrain.cp_ring_attention,
          "all_gather": torch.ops.dtrain.cp_all_gather_attention,
          "a2a": torch.ops.dtrain.cp_a2a_attention}
CP_ATTENTION_OPS = tuple(op.default for op in CP_OPS.values())
