"""The bf16 linears' weights cast once per step and the embedding's gradient added row by row
(``model.cast_weights_once_per_step``).

Under autocast on fp32 weights, every micro-batch's forward casts each linear's weight to bf16 (a
read of 4 bytes and a write of 2 per parameter), and every backward hands autograd a bf16 weight
gradient, which it casts to an fp32 copy and then adds into ``.grad`` (6 + 12 bytes per
parameter). ``StepLinearWeights`` casts each weight once, before the step's first micro-batch;
every forward uses that copy, and its backward (``LinearInto``) adds the weight gradient into
the fp32 ``.grad`` in place, on a GPU inside the weight-gradient GEMM itself
(``dtrain.kernels.accumulate``: no bf16 product is written, cast or added). On the GPU the
product is summed into fp32 without first being rounded to bf16; on the CPU it is rounded and
added as autograd adds it (the same numbers as without).

For plain ``nn.Linear`` layers with fp32 weights whole on the rank (no FSDP, which gathers bf16
weights itself, nor TP), with gradient accumulation (with one micro-batch a step there is
nothing to reuse, and the copy would only be held longer). Costs a bf16 copy of those weights
(2 bytes per parameter) for the step.

The token embedding's gradient has the same shape as its table, but a micro-batch reads a few
thousand of its rows: autograd's backward writes a zeroed fp32 gradient of the whole table
(vocabulary x dim: 2.1 GB for Llama 3 8B) every micro-batch, then adds all of it into ``.grad``.
``StepEmbeddingGrads`` adds the rows read into ``.grad`` in place instead (``EmbeddingInto``),
with autograd's sums: each row's gradients in the micro-batch summed in token order, then added.

A frozen weight's layer uses the step's copy without a weight gradient (a table, its own
forward), so the optimizer skips it and the clipping norm leaves it out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.hooks import step_grad
from dtrain.kernels.accumulate import accumulate_matmul
from dtrain.step_weights.copies import StepCopies


class LinearInto(torch.autograd.Function):
    """``F.linear(x, weight)`` with ``weight`` the step's copy of a parameter in the compute
    dtype; the weight gradient is added into ``grad`` (the parameter's fp32 ``.grad``) in place
    by ``accumulate_matmul`` (``tune``: with cuBLASLt's fastest algorithm for its shapes), and
    the copy gets none from autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                tune: bool = False) -> torch.Tensor:
        ctx.input_dtype, ctx.tune = x.dtype, tune
        x = x.to(weight.dtype)
        ctx.save_for_backward(x, weight, grad)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, grad = ctx.saved_tensors
        grad_out = grad_out.to(weight.dtype)
        accumulate_matmul(grad, grad_out.flatten(0, -2).t(), x.flatten(0, -2), ctx.tune)
        return (grad_out @ weight).to(ctx.input_dtype), None, None, None


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the step's weight and gradient where there are (training; a
    frozen weight's copy without a gradient), else the module's own (evaluation, or before the
    first step)."""
    if self._step is None or not torch.is_grad_enabled():
        return type(self).forward(self, input)
    weight, grad, tune = self._step
    if grad is None:  # frozen: autocast's product, from the step's copy
        output = F.linear(input.to(weight.dtype), weight)
    else:
        output = LinearInto.apply(input, weight, grad, tune)
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


class StepLinearWeights(StepCopies):
    """Casts the weights of ``linears`` to ``dtype`` before each step and gives each a zero
    ``.grad`` (where it has none; none where frozen: ``step_grad``); every micro-batch's forward
    uses the copies, and its backward adds the weight gradients into ``.grad`` in place
    (``LinearInto``); the copies are dropped before the update (their values would be stale
    after it). ``units``: see ``StepCopies``; ``tune``: the GEMMs that add into ``.grad`` run
    cuBLASLt's fastest algorithm for their shapes (``dtrain.kernels.cublaslt_binding``)."""

    def __init__(self, linears: Sequence[nn.Linear], dtype: torch.dtype,
                 units: Sequence[nn.Module] = (), tune: bool = False):
        self.dtype, self.tune = dtype, tune
        super().__init__(linears, _forward, units)

    def cast(self, linears: Sequence[nn.Linear]) -> None:
        for linear in linears:
            linear._step = (linear.weight.detach().to(self.dtype), step_grad(linear.weight),
                            self.tune)

    def describe(self) -> str:
        tuned = (", by cuBLASLt's fastest algorithms (timed at the first step)"
                 if self.tune and self.layers[0].weight.is_cuda else "")
        return (f"{len(self.layers)} linears cast to {str(self.dtype).removeprefix('torch.')} "
                f"once per step, their gradients added into fp32 .grad in place{tuned}")


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
    if self._step is None or not torch.is_grad_enabled():
        return type(self).forward(self, tokens)
    return EmbeddingInto.apply(tokens, self.weight, self._step)


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

    def __init__(self, embeddings: Sequence[nn.Embedding], units: Sequence[nn.Module] = ()):
        super().__init__(embeddings, _embedding_forward, units)

    def cast(self, embeddings: Sequence[nn.Embedding]) -> None:
        for embedding in embeddings:
            embedding._step = step_grad(embedding.weight)

    def describe(self) -> str:
        tables = "1 embedding table's" if len(self.layers) == 1 else \
            f"{len(self.layers)} embedding tables'"
        return f"{tables} gradients added into fp32 .grad row by row"
