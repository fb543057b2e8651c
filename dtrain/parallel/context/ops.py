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


def _fake_out(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return (q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=math_dtype(q)))


def _fake_grads(*tensors: torch.Tensor):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


ring_attention.register_fake(lambda q, k, v, group, kernel, scale: _fake_out(q, v))
all_gather_attention.register_fake(lambda q, k, v, group, kernel, scale: _fake_out(q, v))


@a2a_attention.register_fake
def _(q, k, v, group, kernel, scale):
    n = shards_of(group).size
    b, s, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    empty = partial(q.new_empty, dtype=q.dtype)
    return (empty((b, s, h, dv)), empty((b, s * n, h // n, d)), empty((b, s * n, hk // n, d)),
            empty((b, s * n, hk // n, dv)), empty((b, s * n, h // n, dv)),
            q.new_empty((b, h // n, s * n), dtype=math_dtype(q)))


for _backward_op in (ring_attention_backward, all_gather_attention_backward):
    _backward_op.register_fake(lambda dout, q, k, v, out, lse, group, kernel, scale:
                               _fake_grads(q, k, v))


@a2a_attention_backward.register_fake
def _(dout, qh, kh, vh, out_h, lse_h, group, kernel, scale):
    n = shards_of(group).size
    b, s, h, _ = dout.shape
    hk = kh.shape[2] * n
    empty = partial(dout.new_empty, dtype=dout.dtype)
    return (empty((b, s, h, qh.shape[-1])), empty((b, s, hk, kh.shape[-1])),
            empty((b, s, hk, vh.shape[-1])))


def _save_inputs_and_outputs(ctx, inputs, output) -> None:
    q, k, v, group, kernel, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group, ctx.kernel, ctx.scale = group, kernel, scale


def _save_head_split(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.group, ctx.kernel, ctx.scale = inputs[3:]


def _backward_with(op):
    def backward(ctx, dout, *unused):
        grads = op(dout.contiguous(), *ctx.saved_tensors, ctx.group, ctx.kernel, ctx.scale)
        return (*grads, None, None, None)
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
