"""The Triton kernels of ``dtrain.kernels`` (CUDA only: imported where a CUDA tensor needs one).

RoPE: Inductor's kernel for the interleaved pairs (``rope.rotate_pairs``, compiled) loads each
channel of a pair with a stride-2 gather and ran at about 1.2 TB/s on an H200 (0.105 ms for the
64 MB of one micro-batch's queries); here each program loads whole rows (128-bit loads), splits
them into pairs in registers and stores whole rows.

Cross-entropy: Inductor's online-softmax reduction over a 128,256-wide row read the bf16
logits at about 1.1 TB/s (1.85 ms for 2.1 GB); here one program per row keeps a running maximum
and sum per lane and reads the row once (forward), and the backward writes
``g * (softmax - one_hot)`` from the logits and the saved log-sum-exp in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_sin_ptr, out_ptr, rows, heads, seq, sign,
                 HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    mask = (row < rows)[:, None]
    position = (row // heads) % seq
    cols = tl.arange(0, 2 * HALF)[None, :]
    x = tl.load(x_ptr + row[:, None] * (2 * HALF) + cols, mask=mask).to(tl.float32)
    cos_sin = tl.load(cos_sin_ptr + position[:, None] * (2 * HALF) + cols, mask=mask)
    a, b = tl.split(tl.reshape(x, [BLOCK_ROWS, HALF, 2]))
    cos, sin = tl.split(tl.reshape(cos_sin, [BLOCK_ROWS, HALF, 2]))
    sin = sin * sign
    rotated = tl.join(a * cos - b * sin, a * sin + b * cos)
    tl.store(out_ptr + row[:, None] * (2 * HALF) + cols,
             tl.reshape(rotated, [BLOCK_ROWS, 2 * HALF]).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos_sin: torch.Tensor, sign: float) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) contiguous, cos_sin (seq, head_dim // 2, 2) fp32
    contiguous: each channel pair rotated by sign x its angle."""
    batch, seq, heads, head_dim = x.shape
    out = torch.empty_like(x)
    rows = batch * seq * heads
    block_rows = max(1, 4096 // head_dim)
    _rope_kernel[(triton.cdiv(rows, block_rows),)](
        x, cos_sin, out, rows, heads, seq, sign, HALF=head_dim // 2, BLOCK_ROWS=block_rows,
        num_warps=4)
    return out


@triton.jit
def _cross_entropy_forward(logits_ptr, labels_ptr, loss_ptr, lse_ptr, vocab, stride,
                           ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = logits_ptr + row * stride
    running_max = tl.full([BLOCK], -1e30, tl.float32)  # finite: a lane past the row stays 0
    running_sum = tl.zeros([BLOCK], tl.float32)
    for first in range(0, vocab, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        x = tl.load(start + cols, mask=cols < vocab, other=-1e30).to(tl.float32)
        new_max = tl.maximum(running_max, x)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
        running_max = new_max
    row_max = tl.max(running_max, 0)
    lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), 0))
    label = tl.load(labels_ptr + row)
    inside = (label >= 0) & (label < vocab)
    target = tl.load(start + label, mask=inside, other=float("nan")).to(tl.float32)
    loss = tl.where(label == ignore_index, 0.0, lse - target)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_backward(logits_ptr, labels_ptr, lse_ptr, grad_loss_ptr, grad_ptr, vocab,
                            stride, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(grad_loss_ptr).to(tl.float32)
    scale = tl.where(label == ignore_index, 0.0, scale)
    for first in range(0, vocab, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=mask).to(tl.float32)
        grad = scale * (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0))
        tl.store(grad_ptr + row * vocab + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


_BLOCK = 4096


def cross_entropy_forward(logits: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (rows, vocab) with unit column stride, labels (rows,) int64 -> (each row's loss,
    0 where ignored; each row's log-sum-exp), fp32."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    _cross_entropy_forward[(rows,)](logits, labels, loss, lse, vocab, logits.stride(0),
                                    ignore_index, BLOCK=_BLOCK, num_warps=8)
    return loss, lse


def cross_entropy_backward(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                           grad_loss: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The logits' gradient (rows, vocab) in their dtype, from the summed loss's gradient
    ``grad_loss`` (a scalar on the device: read there, no sync)."""
    rows, vocab = logits.shape
    grad = torch.empty(rows, vocab, device=logits.device, dtype=logits.dtype)
    _cross_entropy_backward[(rows,)](logits, labels, lse, grad_loss, grad, vocab,
                                     logits.stride(0), ignore_index, BLOCK=_BLOCK, num_warps=8)
    return grad
