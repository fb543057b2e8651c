"""FLOPs per token, MFU and peak lookup arithmetic (torchtitan's convention)."""

import json

import pytest
import torch

from dtrain.config import MetricsConfig
from dtrain.log import setup_logging
from dtrain.metrics import (
    MetricsLogger,
    alloc_retries,
    flops_per_token,
    mfu,
    model_flops_per_token,
    peak_tflops,
)
from dtrain.models import build


def test_flops_per_token_formula():
    assert flops_per_token(1000, 2, 4, 8, 16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16


def test_llama3_8b_flops_per_token_excludes_input_embedding_only():
    model = build("llama3_8b", device="meta")
    non_embedding = 8_030_261_248 - 128256 * 4096
    expected = 6 * non_embedding + 12 * 32 * 32 * 128 * 8192
    assert model_flops_per_token(model, 8192) == expected
    # torchtitan reports 9,370 tokens/s/GPU as 543 TFLOP/s for this model and seq_len.
    assert 9370 * expected / 1e12 == pytest.approx(543, abs=0.5)


def test_mfu_arithmetic():
    # 1,000 tokens/s at 1e11 FLOPs/token is 100 TFLOP/s: 10% of a 1,000 TFLOP/s peak.
    assert mfu(1000, 10**11, 1000.0) == pytest.approx(0.1)
    assert mfu(9370, 57_914_449_920, 989.0) == pytest.approx(0.5487, abs=1e-4)


def test_peak_override_and_cpu_has_none():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), override=123.0) == 123.0


def test_logger_writes_jsonl_and_tensorboard(tmp_path, capsys):
    setup_logging(rank=0)  # the console handler a Trainer installs
    logger = MetricsLogger(MetricsConfig(), tmp_path, enabled=True)
    record = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_second_per_device": 1000.0,
              "tflops_per_device": 1.0, "mfu_percent": 10.0, "step_time_s": 0.5,
              "data_wait_percent": 1.0, "peak_memory_gib": 2.0, "eta_s": 65.0}
    logger.log(5, 10, record)
    logger.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["step"] == 5 and row["loss"] == 2.5
    assert list((tmp_path / "tb" / tmp_path.name).glob("events.out.tfevents.*"))  # job's run
    line = capsys.readouterr().out
    assert "step  5/10" in line and "loss 2.5000" in line and "MFU 10.0%" in line
    assert "ETA 0:01:05" in line


def test_allocator_retries_are_shown_only_when_they_happen():
    record = {"loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_second_per_device": 1000.0,
              "tflops_per_device": 1.0, "step_time_s": 0.5, "data_wait_percent": 1.0,
              "peak_memory_gib": 2.0, "eta_s": 65.0}
    assert "allocator" not in MetricsLogger.format_line(5, 10, record)
    assert "allocator" not in MetricsLogger.format_line(5, 10, {**record, "alloc_retries": 0})
    line = MetricsLogger.format_line(5, 10, {**record, "alloc_retries": 3})
    assert "3 allocator retries" in line and "expandable_segments:True" in line
    assert line.endswith("50% ETA 0:01:05")
    assert alloc_retries(torch.device("cpu")) is None


def test_flops_per_token_with_narrower_value_heads():
    # Scores over the query/key width, values over the value width: 6 L H (d + d_v) T.
    assert flops_per_token(1000, 2, 4, 8, 16, v_head_dim=4) == 6 * 1000 + 6 * 2 * 4 * 12 * 16


def test_deepseek_v3_flops_count_mla_heads_the_mtp_depth_and_its_output_layer():
    from dtrain.plan.blocks import model_flops_per_token as planned

    model, seq = build("deepseek_v3_671b", device="meta"), 4096
    # 128 heads of 128 + 64 query/key and 128 value channels, in the 61 layers and the depth.
    attention = 6 * (61 + 1) * 128 * (192 + 128) * seq
    # The depth's logits come from the output layer too: its 129,280 x 7,168 once more.
    weights = model.num_params(exclude_embedding=True, active=True) + 129280 * 7168
    assert model_flops_per_token(model, seq) == 6 * weights + attention
    assert planned(model.args, seq) == model_flops_per_token(model, seq)  # the planner's
    without_mtp = build("deepseek_v3_16b", device="meta")
    assert model_flops_per_token(without_mtp, seq) == (
        6 * without_mtp.num_params(exclude_embedding=True, active=True)
        + 6 * 27 * 16 * (192 + 128) * seq)
