"""Weights cast once per optimizer step, with their gradients added into ``.grad`` in place
(``model.cast_weights_once_per_step``).

Without FSDP, the weights are fp32 and autocast computes in bf16: every micro-batch's forward
casts each weight to bf16 (a read of 4 bytes and a write of 2 per parameter), and every backward
hands autograd a bf16 weight gradient, which it casts to an fp32 copy and then adds into
``.grad`` (6 + 12 bytes per parameter). The weights do not change inside a step, so
``StepWeights`` casts each linear's weight once, before the step's first micro-batch, and every
forward uses that copy; its backward (``LinearInto``) adds the weight gradient into the fp32
``.grad`` in place, on a GPU inside the weight-gradient GEMM itself (``accumulate_matmul``: the
GEMM reads and writes the fp32 gradient, no bf16 product is written, cast or added), as
Megatron-LM's gradient-accumulation fusion writes into its fp32 main gradients. On the GPU the
product is summed into fp32 without first being rounded to bf16; on the CPU it is rounded and
added as autograd adds it (the same numbers as without).

For plain ``nn.Linear`` layers with fp32 weights that are whole tensors on the rank (no FSDP,
which gathers bf16 weights itself, nor TP), with gradient accumulation (with one micro-batch a
step there is nothing to reuse, and the copy would only be held longer). Costs a bf16 copy of
those weights (2 bytes per parameter) for the step. (FP8 linears are torchao's: there
``dtrain.parallel.fp8_step_cast`` adds the weight gradient into ``.grad`` after torchao's GEMM.)

The token embedding's gradient has the same shape as its table, but a micro-batch reads a few
thousand of its rows: autograd's backward writes a zeroed fp32 gradient of the whole table
(vocabulary x dim: 2.1 GB for Llama 3 8B) every micro-batch, then adds all of it into ``.grad``.
``StepEmbeddingGrads`` adds the rows read into ``.grad`` in place instead (``EmbeddingInto``),
with autograd's sums: each row's gradients in the micro-batch summed in token order, then added.

A weight frozen at a step (``requires_grad`` False, read at each step: ``hooks.step_grad``) gets
no ``.grad``: its layer's forward uses the step's copy without a weight gradient (a table, its
own forward), so the optimizer skips it and the clipping norm leaves it out.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.hooks import StepHook, step_grad
from dtrain.log import logger
from dtrain.parallel.overlap import StepCopies


@functools.cache
def _gemm_accumulates(device: torch.device) -> bool:
    """Whether this GPU's ``addmm`` takes bf16 operands into an fp32 output in place (cuBLAS
    with beta 1; ``out_dtype``, torch 2.9 and later): checked once per device against the exact
    sum of a small product of small integers, with autocast off (the backward runs inside the
    forward's autocast, which would compute the check in bf16) and no random numbers drawn (it
    runs inside the first backward). Where it does not work, a warning says so: the gradients
    are then added in a second pass."""
    a = (torch.arange(64 * 48, device=device) % 7 - 3).reshape(64, 48).to(torch.bfloat16)
    b = (torch.arange(48 * 32, device=device) % 5 - 2).reshape(48, 32).to(torch.bfloat16)
    expected = 1 + a.double().cpu() @ b.double().cpu()  # small integers: exact in fp32
    total = torch.ones(64, 32, device=device)
    try:
        with torch.autocast(device.type, enabled=False):
            torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        works = torch.equal(total.double().cpu(), expected)
    except (RuntimeError, TypeError) as error:
        works, why = False, str(error).splitlines()[0]
    else:
        why = "its result differs from the exact sum"
    if not works:
        logger.warning("the accumulating GEMM (torch.addmm(..., out_dtype=torch.float32, "
                       "out=grad)) does not work on %s (%s): the step weights' gradients are "
                       "added in a second pass", device, why)
    return works


@torch.library.custom_op("dtrain::accumulate_matmul", mutates_args=("total",))
def accumulate_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` in place: ``a`` and ``b`` in the compute dtype, ``total`` a weight's
    fp32 gradient. On a GPU one GEMM that accumulates into ``total`` (cuBLAS's beta = 1: the
    product is summed in fp32, never rounded to bf16, and no second pass reads it back: Megatron's
    gradient-accumulation fusion); elsewhere the product, then an add. The dtypes are the
    operands' own, whatever autocast is on."""
    if total.is_cuda and _gemm_accumulates(total.device):
        with torch.autocast("cuda", enabled=False):
            torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total.add_(a @ b)


@accumulate_matmul.register_fake
def _(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


class LinearInto(torch.autograd.Function):
    """``F.linear(x, weight)`` with ``weight`` the step's copy of a parameter in the compute
    dtype; the weight gradient is added into ``grad`` (the parameter's fp32 ``.grad``) in place
    by ``accumulate_matmul``, and the copy gets none from autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.input_dtype = x.dtype
        x = x.to(weight.dtype)
        ctx.save_for_backward(x, weight, grad)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, grad = ctx.saved_tensors
        grad_out = grad_out.to(weight.dtype)
        accumulate_matmul(grad, grad_out.flatten(0, -2).t(), x.flatten(0, -2))
        return (grad_out @ weight).to(ctx.input_dtype), None, None


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the step's weight and gradient where there are (training; a
    frozen weight's copy without a gradient), else the module's own (evaluation, or before the
    first step)."""
    if self._step is None or not torch.is_grad_enabled():
        return type(self).forward(self, input)
    weight, grad = self._step
    if grad is None:  # frozen: autocast's product, from the step's copy
        output = F.linear(input.to(weight.dtype), weight)
    else:
        output = LinearInto.apply(input, weight, grad)
    return output if self.bias is None else output + self.bias.to(output.dtype)


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


class StepWeights(StepCopies):
    """Casts the weights of ``linears`` to ``dtype`` before each step and gives each a zero
    ``.grad`` (where it has none; none where frozen: ``step_grad``); every micro-batch's forward
    uses the copies, and its backward adds the weight gradients into ``.grad`` in place
    (``LinearInto``); the copies are dropped before the update (their values would be stale
    after it). ``units``: see ``StepCopies``."""

    attr = "_step"

    def __init__(self, linears: Sequence[nn.Linear], dtype: torch.dtype,
                 units: Sequence[nn.Module] = ()):
        self.dtype = dtype
        super().__init__(linears, _forward, units)

    def _cast(self, linears: Sequence[nn.Linear]) -> None:
        for linear in linears:
            linear._step = (linear.weight.detach().to(self.dtype), step_grad(linear.weight))


class EmbeddingInto(torch.autograd.Function):
    """``F.embedding(tokens, weight)`` whose backward adds the gradients of the rows the tokens
    read into ``grad`` (the table's fp32 ``.grad``) in place: each row's gradients of the
    micro-batch are summed first, in token order, then added to its row of ``grad``, as
    autograd sums them; the table gets no gradient from autograd.

    The rows' sums are ``F.embedding``'s own backward into one slot per run of equal tokens
    (the tokens renumbered by their runs once sorted, which keeps their order, so the sums are
    autograd's), not a table's worth of rows; without a device-to-host sync (``torch.unique``
    would wait for the GPU to say how many rows there are). The slots past the last run hold
    zeros; each is added into a different row (the nth into row n), which it leaves as it is."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor,
                grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.grad = grad
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        grad = ctx.grad
        flat = tokens.flatten()
        rows, order = flat.sort(stable=True)
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[1:] = rows[1:] != rows[:-1]
        runs = starts.cumsum(0) - 1  # the run of equal tokens each sorted token belongs to
        run_of_token = torch.empty_like(runs).scatter_(0, order, runs)
        sums = torch.ops.aten.embedding_dense_backward(
            grad_out.reshape(-1, grad.shape[1]), run_of_token, len(flat), -1, False)
        run_rows = torch.arange(len(flat), device=flat.device) % grad.shape[0]
        run_rows.index_put_((runs,), rows)  # each run's row (all its tokens write the same)
        grad.index_put_((run_rows,), sums.to(grad.dtype), accumulate=True)
        return None, None, None


def _embedding_forward(self: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding.forward`` adding into the step's ``.grad`` where there is one (training),
    else the module's own (evaluation, before the first step, or the table frozen)."""
    if self._step_grad is None or not torch.is_grad_enabled():
        return type(self).forward(self, tokens)
    return EmbeddingInto.apply(tokens, self.weight, self._step_grad)


def step_grad_embeddings(model_parts: Sequence[nn.Module]) -> list[nn.Embedding]:
    """The plain ``nn.Embedding`` tables of ``model_parts`` with fp32 weights whole on the rank
    (not DTensors), used by that module alone (not tied to the output layer) and without the
    options that change the gradient (padding index, max norm, frequency scaling, sparse)."""
    from torch.distributed.tensor import DTensor

    uses = Counter(id(p) for part in model_parts for m in part.modules()
                   for p in m.parameters(recurse=False))
    return [m for part in model_parts for m in part.modules()
            if type(m) is nn.Embedding and m.weight.dtype == torch.float32
            and not isinstance(m.weight, DTensor) and uses[id(m.weight)] == 1
            and m.padding_idx is None and m.max_norm is None
            and not m.scale_grad_by_freq and not m.sparse]


class StepEmbeddingGrads(StepCopies):
    """Gives each of ``embeddings`` a zero ``.grad`` before each step (where it has none; none
    where frozen: ``step_grad``), into which every micro-batch's backward adds the rows its
    tokens read (``EmbeddingInto``). ``units``: see ``StepCopies``."""

    attr = "_step_grad"

    def __init__(self, embeddings: Sequence[nn.Embedding], units: Sequence[nn.Module] = ()):
        super().__init__(embeddings, _embedding_forward, units)

    def _cast(self, embeddings: Sequence[nn.Embedding]) -> None:
        for embedding in embeddings:
            embedding._step_grad = step_grad(embedding.weight)


class ExpertWeightCasts(StepHook):
    """Casts the stacked weights of ``experts`` (``GroupedExperts`` modules whose weights are
    whole tensors on the rank: no FSDP, TP nor EP) before each step, for every micro-batch's
    grouped GEMMs, and gives each weight a zero gradient that their backwards add into in
    place (none where frozen: ``step_grad``); the casts are dropped before the update. Costs
    one copy of those weights in the compute dtype for the step (bf16: 2 bytes a parameter,
    FP8: 2 x 1 byte)."""

    def __init__(self, experts: Sequence[nn.Module], dtype: torch.dtype):
        self.experts, self.dtype = list(experts), dtype

    def before_step(self) -> None:
        for module in self.experts:
            weights = (module.w1, module.w2, module.w3)
            module.step = [(operands, step_grad(weight)) for operands, weight
                           in zip(module.cast_weights(self.dtype), weights, strict=True)]

    def before_update(self) -> None:
        for module in self.experts:
            module.step = None

    def abandon_step(self) -> None:
        self.before_update()
