"""AdamW's update as one Triton kernel per parameter (``optimizer.implementation = "triton"``).

The update is torch's AdamW's (decoupled weight decay, bias-corrected moments), and so is the
optimizer around it: ``TritonAdamW`` is a ``torch.optim.AdamW`` whose ``step`` launches this
kernel in place of torch's fused one, with the same state (``step`` on the device, ``exp_avg``,
``exp_avg_sq``), so checkpoints move between the two either way. Like torch's fused kernel it
reads ``optimizer.grad_scale`` (the gradient-clipping coefficient that ``dtrain.optim`` folds
into the step) and ``optimizer.found_inf`` (a non-finite step skipped on the device) inside the
kernel, with no host sync.

Why: the update is a stream over four fp32 tensors a parameter (read the weight, gradient and
both moments, write three of them). At Mixtral's 3.2B parameters on one H100 a kernel of this
form (before the scale and the flag were added) ran at the device's copy speed, torch's fused
kernel 12% below it; not yet timed in training (docs/benchmarks.md).

On CUDA tensors, and on CPU tensors in Triton's interpreter (the tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Elements a program: 1,024 on 4 warps ran at the copy speed on an H100, as did 512 to 4,096;
# the interpreter runs each program in Python, so it takes fewer, larger ones.
BLOCK = 16384 if INTERPRETED else 1024


@triton.jit
def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, scale_ptr, skip_ptr, n, lr, beta1, beta2,
                 eps, weight_decay, BLOCK: tl.constexpr):
    if tl.load(skip_ptr) != 0:  # a non-finite step: weights and moments stay as they are
        return
    step = tl.load(step_ptr).to(tl.float32)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32) / tl.load(scale_ptr)
    m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    correction1 = 1 - tl.exp2(step * tl.log2(beta1))
    correction2 = 1 - tl.exp2(step * tl.log2(beta2))
    p = p - (lr / correction1) * m / (tl.sqrt(v) / tl.sqrt(correction2) + eps)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _constant(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA, or the CPU in Triton's interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and INTERPRETED)


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` with the update in ``adamw_kernel``: the same options,
    state and ``grad_scale``/``found_inf`` hooks (so ``dtrain.optim.folds_clipping`` holds).
    amsgrad, maximize and a tensor learning rate are not offered."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         fused=True)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # as torch's fused AdamW makes it
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, skip = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            for p, state in zip(params, states, strict=True):
                _update(_local(p), _local(p.grad), _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]), state["step"], scale, skip,
                        float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
            if skip is not None:  # a skipped step is not counted, as in torch's fused AdamW
                torch._foreach_sub_(steps, [skip.to(torch.float32)] * len(steps))
        return loss


def _update(p, g, m, v, step, scale, skip, lr, beta1, beta2, eps, weight_decay) -> None:
    if not runs_on(p.device):
        raise RuntimeError(f"optimizer.implementation = 'triton' runs on CUDA; this parameter is "
                           f"on {p.device}: set optimizer.implementation = 'auto'")
    if not all(t.is_contiguous() for t in (p, g, m, v)):
        raise RuntimeError("optimizer.implementation = 'triton' updates contiguous parameters, "
                           "gradients and moments; set optimizer.implementation = 'fused'")
    n = p.numel()
    if n == 0:
        return
    scale = _constant(1.0, p.device) if scale is None else scale
    skip = _constant(0.0, p.device) if skip is None else skip
    adamw_kernel[(triton.cdiv(n, BLOCK),)](p, g, m, v, step, scale, skip, n, lr, beta1, beta2,
                                           eps, weight_decay, BLOCK=BLOCK)
