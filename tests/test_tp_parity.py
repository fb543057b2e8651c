"""Tensor parallel with sequence parallel (and loss parallel) over gloo reproduces the
single-process run: equal initial weights, per-step losses and gradient norms within 1e-5
relative over 6 steps, with gradient accumulation and activation checkpointing."""

import pytest
from conftest import BASE, assert_same_run, run_distributed

from dtrain.config import ConfigError
from dtrain.models import model_args
from dtrain.parallel.tensor import check_async_tp, check_tp


def specs(tmp_path, parallel: dict, variants: list[dict]) -> list[dict]:
    return [{**BASE, **parallel, **variant, "job.name": f"run{i}",
             "job.output_dir": str(tmp_path)} for i, variant in enumerate(variants)]


@pytest.mark.parametrize("nproc, parallel, variants", [
    # TP only: 1 data rank, so 8 micro-batches are accumulated per step.
    (2, {"parallel.tp": 2, "parallel.dp_shard": 1},
     [{}, {"activation_checkpoint.mode": "op"}, {"parallel.loss_parallel": False}]),
    # One 4-rank launch: TP 4, then 2-D FSDP over 2 data ranks x TP 2 (4 micro-batches
    # accumulated).
    (4, {},
     [{"parallel.tp": 4, "parallel.dp_shard": 1},
      {"parallel.tp": 4, "parallel.dp_shard": 1, "activation_checkpoint.mode": "full"},
      {"parallel.tp": 2, "parallel.dp_shard": 2},
      {"parallel.tp": 2, "parallel.dp_shard": 2, "activation_checkpoint.mode": "op"}]),
], ids=["tp2", "tp4-tp2xfsdp2"])
def test_tensor_parallel_matches_single_process(tmp_path, reference, nproc, parallel, variants):
    runs = run_distributed(tmp_path, nproc, specs(tmp_path, parallel, variants))
    for run, variant in zip(runs, variants, strict=True):
        assert_same_run(run, reference, f"{parallel} {variant}")
        assert run["compute_dtype"] == "torch.float32"


def test_tensor_parallel_trains_in_bf16_without_fsdp(tmp_path, reference):
    # Autocast: bf16 matmuls on fp32 master weights. bf16 has 8 bits of mantissa, so the losses
    # of the first steps agree with fp32 to about 1%, not 1e-5.
    (run,) = run_distributed(tmp_path, 2, specs(
        tmp_path, {"parallel.tp": 2, "parallel.dp_shard": 1},
        [{"training.mixed_precision": "bf16"}]))
    assert run["compute_dtype"] == "torch.bfloat16"
    for ref, got in zip(reference, run["history"], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-2)


@pytest.mark.parametrize("tp, seq_len, message", [
    (8, 64, "parallel.tp = 8 does not divide the model's n_kv_heads"),
    (3, 64, "parallel.tp = 3 does not divide the model's n_heads"),
    (4, 66, "training.seq_len = 66 is not divisible by parallel.tp = 4"),
])
def test_impossible_tensor_parallel_degrees(tp, seq_len, message):
    with pytest.raises(ConfigError, match=message):
        check_tp(model_args("llama3_debug"), tp, seq_len)


def test_async_tp_needs_cuda_and_compile():
    with pytest.raises(ConfigError, match="async_tp = true needs CUDA GPUs"):
        check_async_tp("cpu", compiled=True)
    with pytest.raises(ConfigError, match="compile.enabled = true"):
        check_async_tp("cuda", compiled=False)
    check_async_tp("cuda", compiled=True)
