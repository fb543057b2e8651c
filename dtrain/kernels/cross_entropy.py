"""The summed token cross-entropy as one custom op (``dtrain::cross_entropy_sum``): Triton
kernels on CUDA (``dtrain.kernels.gpu``: the forward reads the logits once and keeps each row's
log-sum-exp, the backward writes the logits' gradient in one pass), ``F.cross_entropy`` in fp32
elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def kernel_applies(logits: torch.Tensor) -> bool:
    """Whether the Triton kernels run for these (rows, vocab) logits: CUDA, a floating dtype,
    unit column stride."""
    return (logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32))


def check_inputs(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """The shapes (rows, vocab) and (rows,) or a ValueError; every label in [0, vocab) or -100,
    or a RuntimeError as ``F.cross_entropy`` gives (on CUDA a device-side assertion: no host
    synchronisation, and the loss is never silently NaN)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_sum: logits (rows, vocab) and labels (rows,) expected, "
                         f"got {tuple(logits.shape)} and {tuple(labels.shape)}")
    vocab = logits.shape[1]
    torch._assert_async(((labels >= 0) & (labels < vocab) | (labels == IGNORE_INDEX)).all(),
                        f"cross_entropy_sum: a label is outside [0, {vocab}) and is not "
                        f"{IGNORE_INDEX}")


@torch.library.custom_op("dtrain::cross_entropy_sum", mutates_args=())
def cross_entropy_sum(logits: torch.Tensor,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed cross-entropy of logits (rows, vocab) against labels (rows,), rows labelled
    -100 left out, in fp32; each row's log-sum-exp, fp32). Both are differentiable."""
    check_inputs(logits, labels)
    if kernel_applies(logits):
        from dtrain.kernels import gpu

        loss, lse = gpu.cross_entropy_forward(logits, labels.contiguous(), IGNORE_INDEX)
        return loss.sum(), lse
    logits = logits.float()
    return (F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX),
            torch.logsumexp(logits, dim=-1))


@cross_entropy_sum.register_fake
def _(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (logits.new_empty((), dtype=torch.float32),
            logits.new_empty(logits.shape[:1], dtype=torch.float32))


def _setup(ctx, inputs, output) -> None:
    logits, labels = inputs
    ctx.save_for_backward(logits, labels, output[1])
    # An output the loss does not use gets None, not a zero tensor: the training loss uses the
    # sum alone, and a zero lse gradient would cost a vocabulary-wide fp32 pass and its memory.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss: torch.Tensor | None, grad_lse: torch.Tensor | None):
    logits, labels, lse = ctx.saved_tensors
    grad = None
    if grad_loss is not None:
        grad = _logits_grad(logits, labels, lse, grad_loss)
    if grad_lse is not None:  # d lse / d logits = softmax: only where the lse itself is used
        softmax = grad_lse[:, None] * torch.exp(logits.float() - lse[:, None])
        grad = softmax.to(logits.dtype) if grad is None else grad + softmax.to(grad.dtype)
    return grad, None


@torch.library.custom_op("dtrain::cross_entropy_sum_backward", mutates_args=())
def _logits_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                 grad_loss: torch.Tensor) -> torch.Tensor:
    """``grad_loss * (softmax(logits) - one_hot(labels))``, rows labelled -100 zero, in the
    logits' dtype."""
    if kernel_applies(logits):
        from dtrain.kernels import gpu

        return gpu.cross_entropy_backward(logits, labels.contiguous(), lse, grad_loss,
                                          IGNORE_INDEX)
    probs = torch.exp(logits.float() - lse[:, None])
    kept = labels != IGNORE_INDEX
    probs[kept, labels[kept]] -= 1
    probs[~kept] = 0
    return (grad_loss * probs).to(logits.dtype)


@_logits_grad.register_fake
def _(logits, labels, lse, grad_loss) -> torch.Tensor:
    return torch.empty_like(logits)


cross_entropy_sum.register_autograd(_backward, setup_context=_setup)
