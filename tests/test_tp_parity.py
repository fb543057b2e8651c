"""Tensor parallel with sequence parallel (and loss parallel) over gloo reproduces the
single-process run: equal initial weights, per-step losses and gradient norms within 1e-5
relative over 4 steps, with gradient accumulation and activation checkpointing."""


import pytest
import torch
from conftest import (
    BASE,
    assert_same_run,
    logits_and_grads,
    on_two_gloo_ranks,
    run_distributed,
    with_biases_and_norms_drawn,
)
from torch.distributed.device_mesh import init_device_mesh

from dtrain.config import ConfigError
from dtrain.models import model_args
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.parallel.tensor import apply_tp, check_async_tp, check_tp


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


# A Qwen-like shape no preset has: heads of 24 channels (not dim / n_heads = 16), biases on all
# four projections, per-head q/k norms, grouped KV heads.
QWEN_LIKE = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_size=24, qkv_bias=True,
                      out_bias=True, qk_norm=True, vocab_size=128, multiple_of=32,
                      max_seq_len=32, rope_theta=10000.0)


def qwen_like_model() -> Transformer:
    """QWEN_LIKE initialised, its biases and norm weights drawn (the same on every rank)."""
    model = Transformer(QWEN_LIKE)
    model.init_weights(seed=0)
    return with_biases_and_norms_drawn(model)


def qwen_like_tp_worker(rank: int, out: str) -> None:
    model = qwen_like_model()
    apply_tp(model, init_device_mesh("cpu", (2,)), loss_parallel=False)
    logits, grads = logits_and_grads(model)
    if rank == 0:
        torch.save({"logits": logits, "grads": grads}, out)


def test_tensor_parallel_of_head_size_biases_and_qk_norm_matches_one_process(tmp_path):
    # Column-parallel q/k/v biases split with their heads, the row-parallel wo bias replicated,
    # q_norm/k_norm weights replicated over the heads each rank holds. fp32: the two ranks'
    # partial sums differ from one process's only in order. Logits and the gradient norm agree
    # within 1e-5; each gradient within 1e-4 of its largest entry, since those of q and k (and
    # their biases and norms) are small sums of terms that largely cancel (seen: 1.5e-5).
    out = tmp_path / "tp.pt"
    on_two_gloo_ranks(qwen_like_tp_worker, str(out))
    got = torch.load(out)
    logits, grads = logits_and_grads(qwen_like_model())
    assert torch.allclose(got["logits"], logits, rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == grads.keys()
    norm = torch.stack([g.norm() for g in grads.values()]).norm()
    got_norm = torch.stack([g.norm() for g in got["grads"].values()]).norm()
    assert got_norm.item() == pytest.approx(norm.item(), rel=1e-5)
    for name, want in grads.items():
        error = (got["grads"][name] - want).abs().max()
        assert error <= 1e-4 * want.abs().max(), name
