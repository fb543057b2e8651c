"""dtrain.kernels: the RoPE and cross-entropy custom ops against PyTorch's own computation.

On the CPU the ops run their PyTorch reference path, which checks the ops' own backward formulas
(the angles negated; softmax minus one-hot) and their use inside compiled code. The Triton
kernels run through the ops on CUDA (the tests marked so: reported as skipped without a GPU,
their H200 output is in docs/benchmarks.md), and called directly in Triton's interpreter on a
machine without CUDA where Triton is installed (``conftest.INTERPRETED``; CI installs it): the
kernels' own arithmetic, masks and strides, on CPU tensors."""

import pytest
import torch
import torch.nn.functional as F
from conftest import INTERPRETED
from torch.utils._python_dispatch import TorchDispatchMode

from dtrain.kernels.cross_entropy import cross_entropy_sum
from dtrain.kernels.rope import rope
from dtrain.models.llama import apply_rope, rope_cache
from dtrain.step import cross_entropy_sum as reference_cross_entropy_sum
from dtrain.step import fused_cross_entropy_sum

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels need CUDA")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="needs Triton installed, for its "
                                 "interpreter (CI installs it)")


def _rope_inputs(device, dtype, batch=2, seq=48, heads=3, head_dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, head_dim, generator=generator).to(device, dtype)
    cache = rope_cache(max(64, seq), head_dim, 500000.0, None).to(device)
    return x, cache


def test_rope_op_rotates_like_the_complex_product_and_its_backward_is_autograds():
    # fp64 inputs: the op's backward (the rotation by the negated angles) against autograd
    # through the complex multiply, to rounding (1e-12).
    x, cache = _rope_inputs("cpu", torch.float64)
    x_ref = x.clone().requires_grad_()
    x_op = x.clone().requires_grad_()
    expected = apply_rope(x_ref, cache)
    got = rope(x_op, torch.view_as_real(cache[: x.shape[1]]))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x_op.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_rope_op_runs_inside_a_compiled_function_like_eager():
    x, cache = _rope_inputs("cpu", torch.float32)

    def rotate(t):
        return rope(t, torch.view_as_real(cache[: t.shape[1]])) * 2

    torch.testing.assert_close(torch.compile(rotate, fullgraph=True)(x), rotate(x),
                               rtol=0, atol=0)


def _logits(device, dtype, rows=37, vocab=1000, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator).to(device)
    labels[::5] = -100  # ignored rows
    return logits, labels


def test_cross_entropy_op_sums_like_f_cross_entropy_and_its_backward_is_autograds():
    # fp64: the op's closed-form gradient against autograd through F.cross_entropy, including
    # the ignored rows (zero gradient), to rounding.
    logits, labels = _logits("cpu", torch.float64)
    ref = logits.clone().requires_grad_()
    ours = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref, labels, reduction="sum", ignore_index=-100)
    got, lse = cross_entropy_sum(ours, labels)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1).float(), rtol=1e-6, atol=0)
    (expected * 0.25).backward()
    (got * 0.25).backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6, atol=1e-9)
    assert ours.grad[::5].abs().max() == 0


def test_fused_loss_matches_the_reference_loss_on_batched_logits():
    logits, labels = _logits("cpu", torch.float32, rows=24)
    logits, labels = logits.view(2, 12, -1), labels.view(2, 12)
    torch.testing.assert_close(fused_cross_entropy_sum(logits, labels),
                               reference_cross_entropy_sum(logits, labels), rtol=1e-6, atol=0)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_kernel_on_cuda_equals_the_reference(dtype):
    # The kernel and the reference compute the same fp32 products; only the contraction into
    # fused multiply-adds may differ, a last-bit difference in fp32 (bf16 rounding of it:
    # at most one bf16 ulp, 2^-7 relative).
    x, cache = _rope_inputs("cuda", dtype, batch=2, seq=1000, heads=8, head_dim=128)
    x_ref, x_op = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = apply_rope(x_ref, cache)
    got = apply_rope(x_op, cache, kernel=True)
    tolerance = {"rtol": 2 ** -7, "atol": 1e-6} if dtype == torch.bfloat16 else \
        {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, expected, **tolerance)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x_op.grad, x_ref.grad, **tolerance)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_kernels_on_cuda_equal_the_reference(dtype):
    # A vocabulary that is not a multiple of the kernel's 4096-wide block, ignored rows; fp32
    # sums in another order (relative 1e-5 on the summed loss), gradients rounded to the
    # logits' dtype (one bf16 ulp).
    logits, labels = _logits("cuda", dtype, rows=300, vocab=10_000)
    ref, ours = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    expected = reference_cross_entropy_sum(ref[None], labels[None])
    got = fused_cross_entropy_sum(ours[None], labels[None])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    (expected / 7).backward()
    (got / 7).backward()
    tolerance = {"rtol": 2 ** -7, "atol": 1e-7} if dtype == torch.bfloat16 else \
        {"rtol": 1e-5, "atol": 1e-8}
    torch.testing.assert_close(ours.grad, ref.grad, **tolerance)
    assert ours.grad[::5].abs().max() == 0


@cuda
def test_cross_entropy_kernel_turns_an_infinite_logit_into_a_non_finite_loss():
    logits, labels = _logits("cuda", torch.bfloat16, rows=8, vocab=5000)
    logits[3, 7] = float("inf")
    assert not torch.isfinite(fused_cross_entropy_sum(logits[None], labels[None]))


# ---- The ops' input checks: the same on the CPU and on CUDA ----------------------------------

def test_the_log_sum_exp_output_carries_its_gradient():
    logits, labels = _logits("cpu", torch.float64)
    ref = logits.clone().requires_grad_()
    ours = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref, labels, reduction="sum") + 0.5 * torch.logsumexp(ref, -1).sum()
    loss, lse = cross_entropy_sum(ours, labels)
    (loss + 0.5 * lse.sum()).backward()
    expected.backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-6, atol=1e-9)


def test_a_label_outside_the_vocabulary_is_an_error_not_a_nan():
    logits, labels = _logits("cpu", torch.float32)
    labels[2] = logits.shape[1]  # one past the vocabulary
    with pytest.raises(RuntimeError, match=r"a label is outside \[0, 1000\) and is not -100"):
        cross_entropy_sum(logits, labels)


def test_rope_refuses_a_table_of_another_length():
    x, cache = _rope_inputs("cpu", torch.float32, seq=48)
    with pytest.raises(ValueError, match=r"rope: x \(batch, seq, heads, head_dim\) needs cos_sin "
                                         r"\(seq, head_dim // 2, 2\), got x \(2, 48, 3, 16\) and "
                                         r"cos_sin \(64, 8, 2\)"):
        rope(x, torch.view_as_real(cache))  # the whole 64-place cache, not the first 48


@cuda
def test_the_cuda_kernels_take_non_contiguous_labels_and_refuse_bad_ones():
    logits, labels = _logits("cuda", torch.bfloat16, rows=64, vocab=5000)
    strided = torch.stack([labels, labels], dim=1)[:, 0]  # stride 2
    assert not strided.is_contiguous()
    torch.testing.assert_close(cross_entropy_sum(logits, strided)[0],
                               cross_entropy_sum(logits, labels.clone())[0], rtol=0, atol=0)
    x, cache = _rope_inputs("cuda", torch.bfloat16, seq=48)
    with pytest.raises(ValueError, match="rope: x"):
        rope(x, torch.view_as_real(cache))


class BackwardOps(TorchDispatchMode):
    """The operators a backward runs, by name (``aten::exp``, ``dtrain::...``)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def test_an_unused_log_sum_exp_costs_no_gradient_pass():
    # The training loss uses the sum alone: the lse's gradient reaches the backward as None, so
    # it runs the logits' gradient op and no softmax (a zero lse gradient would cost a
    # vocabulary-wide exp to multiply in); the lse alone differentiates too, without that op.
    logits, labels = _logits("cpu", torch.float64)
    used, alone = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, lse = cross_entropy_sum(used, labels)[0], cross_entropy_sum(alone, labels)[1].sum()
    with BackwardOps() as loss_ops:
        loss.backward()
    with BackwardOps() as lse_ops:
        lse.backward()
    gradient_op = "dtrain::cross_entropy_sum_backward"  # softmax minus one-hot
    assert gradient_op in loss_ops.names and "aten::exp" not in loss_ops.names
    assert gradient_op not in lse_ops.names and "aten::exp" in lse_ops.names
    torch.testing.assert_close(alone.grad, torch.softmax(logits, -1), rtol=1e-6, atol=1e-9)


# ---- The Triton kernels in Triton's interpreter (no CUDA) ----------------------------------

@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_kernel_in_the_interpreter_rotates_as_the_reference(dtype):
    # The kernel's rows, pairs and angles: its rotation and its inverse (the angles negated,
    # the backward) against PyTorch's products in fp32; a row count that is no multiple of the
    # kernel's block of rows. One bf16 ulp (2^-7 relative) for the rounding of the last bit.
    from dtrain.kernels import gpu

    x, cache = _rope_inputs("cpu", dtype, batch=2, seq=37, heads=3, head_dim=64)
    cos_sin = torch.view_as_real(cache[:37]).contiguous()
    tolerance = {"rtol": 2 ** -7, "atol": 1e-6} if dtype == torch.bfloat16 else \
        {"rtol": 1e-6, "atol": 1e-6}
    for sign in (1.0, -1.0):
        expected = rope(x, cos_sin, sign)  # the CPU's PyTorch path
        torch.testing.assert_close(gpu.rope(x, cos_sin, sign), expected, **tolerance)
    # two fp32 rotations: the product of their cosines and sines is one up to a few fp32 ulps
    back = gpu.rope(gpu.rope(x.float(), cos_sin, 1.0), cos_sin, -1.0)
    torch.testing.assert_close(back, x.float(), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_kernels_in_the_interpreter_equal_the_reference(dtype):
    # Rows of a vocabulary that is no multiple of the kernels' 4096-wide block, logits rows
    # strided (a slice of wider rows), ignored rows: each row's loss (0 where ignored) and
    # log-sum-exp, and the gradient g * (softmax - one-hot) in the logits' dtype.
    from dtrain.kernels import gpu

    wide, labels = _logits("cpu", dtype, rows=12, vocab=5000)
    logits = wide[:, :4500]
    assert logits.stride(0) == 5000
    loss, lse = gpu.cross_entropy_forward(logits, labels, -100)
    reference = logits.float()
    expected = F.cross_entropy(reference, labels, reduction="none")
    # fp32 sums over 4,500 logits in another order (a running sum per lane): a few ulps of the
    # log-sum-exp (about 10), 1e-5 absolute
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(reference, -1), rtol=1e-6, atol=1e-5)
    assert torch.equal(loss[::5], torch.zeros_like(loss[::5]))
    grad = gpu.cross_entropy_backward(logits, labels, lse, torch.tensor(0.5), -100)
    softmax = torch.softmax(reference, -1)
    one_hot = F.one_hot(labels.clamp(min=0), 4500).float()
    want = (0.5 * (softmax - one_hot)) * (labels != -100)[:, None]
    tolerance = {"rtol": 2 ** -7, "atol": 1e-7} if dtype == torch.bfloat16 else \
        {"rtol": 1e-5, "atol": 1e-8}
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), want, **tolerance)


@interpreted
def test_cross_entropy_kernel_in_the_interpreter_turns_an_infinite_logit_into_a_non_finite_loss():
    from dtrain.kernels import gpu

    logits, labels = _logits("cpu", torch.bfloat16, rows=4, vocab=300)
    labels[:] = 1
    logits[2, 7] = float("inf")
    loss, _ = gpu.cross_entropy_forward(logits, labels, -100)
    assert torch.isfinite(loss[[0, 1, 3]]).all() and not torch.isfinite(loss[2])
