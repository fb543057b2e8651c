"""The weight-gradient GEMMs tuned once per shape (``compile.tune_gemms``;
``dtrain.kernels.cublaslt_binding``): which layers ask for it, and (on a GPU) that the tuned
GEMM adds its product exactly once, the timing leaving the gradient as it was.

Operands are small integers: their products and sums are exact in fp32 whatever the algorithm
and order of the sums, so results are compared for equality."""

from __future__ import annotations

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.kernels import accumulate, cublaslt
from dtrain.kernels.accumulate import accumulate_matmul
from dtrain.kernels.cublaslt import accumulate_scaled_mm
from dtrain.step_weights import linears
from dtrain.step_weights.copies import step_copy
from dtrain.step_weights.fp8_cast import StepWeightCast
from dtrain.step_weights.linears import StepLinearWeights

RUN = {"training.device": "cpu", "model.n_layers": 1, "training.seq_len": 32,
       "training.global_batch_size": 2, "training.micro_batch_size": 1, "training.steps": 1,
       "metrics.log_every": 1, "metrics.tensorboard": False}
GPU_FP8 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs an sm90 GPU (cuBLASLt's GEMMs); its output is in docs/benchmarks.md")


def _hook(trainer: Trainer, kind: type):
    return next(h for h in trainer.hooks.hooks if isinstance(h, kind))


@pytest.mark.parametrize(("tune_gemms", "deterministic", "tuned"),
                         [(True, False, True), (True, True, False), (False, False, False)])
def test_the_dense_weight_gradients_are_tuned_with_tune_gemms_unless_deterministic(
        tmp_path, monkeypatch, tune_gemms, deterministic, tuned):
    trainer = Trainer(load_config("debug", {
        **RUN, "training.mixed_precision": "bf16", "compile.tune_gemms": tune_gemms,
        "training.deterministic": deterministic, "job.output_dir": str(tmp_path)}))
    hook = _hook(trainer, StepLinearWeights)
    asked = []
    real = linears.accumulate_matmul
    monkeypatch.setattr(linears, "accumulate_matmul",
                        lambda total, a, b, tune, real=real: asked.append(tune)
                        or real(total, a, b, tune))
    trainer.train()
    # 7 linears a block and the output layer, 2 micro-batches
    assert asked == [tuned] * (7 + 1) * 2
    assert hook.tune is tuned
    assert "cuBLASLt" not in hook.describe()  # the CPU has no cuBLASLt: the start-up line
    # names the tuning only on a GPU


def test_the_fp8_step_weights_carry_the_tuning_to_their_gemms(tmp_path):
    trainer = Trainer(load_config("debug", {
        **RUN, "fp8.enabled": True, "fp8.emulate": True, "compile.tune_gemms": True,
        "job.output_dir": str(tmp_path)}))
    hook = _hook(trainer, StepWeightCast)
    assert hook.tune and hook.accumulate
    hook.before_step()
    try:
        assert {step_copy(layer)[-1] for layer in hook.layers} == {True}
    finally:
        hook.abandon_step()


def small_integers(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).float().to(dtype).to("cuda")


@GPU_FP8
def test_the_tuned_bf16_gemm_adds_its_product_once(monkeypatch):
    """A weight gradient's layout (the output gradient transposed, a view), large enough for
    the heuristic to list several algorithms: each call adds the exact product once, the timing
    at the first leaving ``total`` as it was."""
    warned = []
    monkeypatch.setattr(accumulate, "warn_untuned", warned.append)
    grad_out = small_integers((4096, 1024), torch.bfloat16, 0)
    x = small_integers((4096, 2048), torch.bfloat16, 1)
    start = small_integers((1024, 2048), torch.float32, 2)
    total = start.clone()
    product = grad_out.double().t() @ x.double()
    for calls in (1, 2):
        accumulate_matmul(total, grad_out.t(), x, tune=True)
        assert torch.equal(total.double(), start.double() + calls * product)
    assert warned == []


@GPU_FP8
def test_the_tuned_fp8_gemm_adds_its_product_once(monkeypatch):
    fallbacks = []
    monkeypatch.setattr(cublaslt, "warn_fallback", fallbacks.append)
    a = small_integers((1024, 4096), torch.float8_e5m2, 0)
    b = small_integers((2048, 4096), torch.float8_e4m3fn, 1).t()
    start = small_integers((1024, 2048), torch.float32, 2)
    total = start.clone()
    scales = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    product = a.double() @ b.double()
    for calls in (1, 2):
        accumulate_scaled_mm(total, a, b, *scales, tune=True)
        assert torch.equal(total.double(), start.double() + calls * product)
    assert fallbacks == []
