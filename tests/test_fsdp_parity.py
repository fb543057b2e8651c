"""FSDP2 and HSDP over gloo reproduce the single-process run: same initial weights, and per-step
losses and gradient norms within 1e-5 relative over 6 steps, with gradient accumulation and every
activation-checkpointing mode."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from dtrain import Trainer, load_config
from dtrain.config import ConfigError, ParallelConfig
from dtrain.parallel.dims import ParallelDims

# A small, fast configuration of the debug recipe: 8 sequences of 64 tokens per step.
BASE = {"model.n_layers": 2, "training.seq_len": 64, "training.global_batch_size": 8,
        "training.micro_batch_size": 1, "training.steps": 6, "lr_schedule.warmup_steps": 2,
        "metrics.log_every": 1, "metrics.tensorboard": False}
AC_MODES = ["none", "full", "layer", "op"]
# fp32 on CPU: the layouts differ only in the order of floating-point sums.
REL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return Trainer(load_config("debug", {**BASE, "job.output_dir": str(out)})).train()


def run_layout(tmp_path, nproc: int, parallel: dict) -> list[dict]:
    spec = [{**BASE, **parallel, "activation_checkpoint.mode": mode,
             "activation_checkpoint.every_n_layers": 2, "job.name": mode,
             "job.output_dir": str(tmp_path)} for mode in AC_MODES]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(ROOT / "tests" / "distributed_runner.py"),
         str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


# Global batch 8 of micro-batches of 1: the 2-rank layout accumulates 4 micro-batches, the 4-rank
# ones 2, the single process 8.
@pytest.mark.parametrize("nproc, parallel", [
    (2, {"parallel.dp_shard": 2}),
    (4, {"parallel.dp_shard": 4}),
    (4, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}),
], ids=["fsdp2", "fsdp4", "hsdp2x2"])
def test_layout_matches_single_process(tmp_path, reference, nproc, parallel):
    runs = run_layout(tmp_path, nproc, parallel)
    assert [r["overrides"]["activation_checkpoint.mode"] for r in runs] == AC_MODES
    for run in runs:
        mode = run["overrides"]["activation_checkpoint.mode"]
        assert run["init_ok"], f"{mode}: initial weights differ from the single-device model"
        assert len(run["history"]) == len(reference) == 6
        for ref, got in zip(reference, run["history"], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=REL), (mode, ref["step"])
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), (mode, ref["step"])


def test_activation_checkpointing_single_process_is_exact(tmp_path, reference):
    for mode in ("full", "op"):
        history = Trainer(load_config("debug", {
            **BASE, "activation_checkpoint.mode": mode, "job.output_dir": str(tmp_path)})).train()
        assert [r["loss"] for r in history] == [r["loss"] for r in reference], mode


@pytest.mark.parametrize("cfg, world, message", [
    (ParallelConfig(tp=3), 8, "do not divide the world size 8"),
    (ParallelConfig(dp_shard=3), 8, r"= 3 but the world size is 8"),
    (ParallelConfig(dp_replicate=2, dp_shard=2), 8, r"= 4 but the world size is 8"),
    (ParallelConfig(ep=3), 4, "parallel.ep=3 must divide dp_shard x cp = 4"),
])
def test_impossible_degrees_name_the_numbers(cfg, world, message):
    with pytest.raises(ConfigError, match=message):
        ParallelDims.from_config(cfg, world)


def test_dp_shard_fills_the_remaining_ranks():
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (2, 4, 8)
