"""RoPE of Meta's interleaved channel pairs as one custom op (``dtrain::rope``): a Triton kernel
on CUDA (``dtrain.kernels.gpu``), the same products in PyTorch elsewhere. Its backward rotates
the gradient back (the same kernel with the angles negated), so nothing is saved but the
angles."""

from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """(a, b) -> (a cos - b sin, a sin + b cos) for each channel pair of x, with the angles'
    cosine and sine as the last dimension of ``cos_sin`` (the complex cache viewed as real)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos_sin.to(x.dtype).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def kernel_applies(x: torch.Tensor) -> bool:
    """Whether ``rope`` runs the Triton kernel for x (batch, seq, heads, head_dim): CUDA, a
    floating dtype, a power-of-two head_dim, and a contiguous layout (a linear's output viewed
    as heads)."""
    head_dim = x.shape[-1]
    return (x.is_cuda and x.dim() == 4 and x.is_contiguous() and head_dim >= 2
            and head_dim & (head_dim - 1) == 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def check_inputs(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """x (batch, seq, heads, head_dim) and cos_sin (seq, head_dim // 2, 2), or a ValueError
    naming both shapes: a table of another length would rotate by other places' angles (or
    read past its end)."""
    if (x.dim() != 4 or cos_sin.dim() != 3 or x.shape[-1] % 2
            or tuple(cos_sin.shape) != (x.shape[1], x.shape[-1] // 2, 2)):
        raise ValueError(f"rope: x (batch, seq, heads, head_dim) needs cos_sin (seq, "
                         f"head_dim // 2, 2), got x {tuple(x.shape)} and cos_sin "
                         f"{tuple(cos_sin.shape)}")


@torch.library.custom_op("dtrain::rope", mutates_args=())
def rope(x: torch.Tensor, cos_sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """x (batch, seq, heads, head_dim) with each channel pair (2i, 2i+1) rotated by ``sign`` x
    its angle at the token's place, in fp32 (fp64 for fp64 x), returned in x's dtype.
    ``cos_sin`` (seq, head_dim // 2, 2) fp32: the angles' cosine and sine for each place of x's
    sequence."""
    check_inputs(x, cos_sin)
    if kernel_applies(x):
        from dtrain.kernels import gpu

        return gpu.rope(x, cos_sin.contiguous(), sign)
    real = x.to(torch.promote_types(x.dtype, torch.float32))
    angles = cos_sin[:, None].to(real.dtype)
    angles = torch.stack([angles[..., 0], sign * angles[..., 1]], dim=-1)
    return rotate_pairs(real, angles).to(x.dtype)


@rope.register_fake
def _(x: torch.Tensor, cos_sin: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    _, cos_sin, sign = inputs
    ctx.save_for_backward(cos_sin)
    ctx.sign = sign


def _backward(ctx, grad: torch.Tensor):
    (cos_sin,) = ctx.saved_tensors
    return rope(grad.contiguous(), cos_sin, -ctx.sign), None, None


rope.register_autograd(_backward, setup_context=_setup)
