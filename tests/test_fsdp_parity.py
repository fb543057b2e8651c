"""FSDP2 and HSDP over gloo reproduce the single-process run: same initial weights, and per-step
losses and gradient norms within 1e-5 relative over 4 steps, with gradient accumulation and every
activation-checkpointing mode."""

import pytest
from conftest import BASE, INTERPRETED, assert_same_run, run_distributed

from dtrain import Trainer, load_config
from dtrain.config import ConfigError, ParallelConfig
from dtrain.parallel.dims import ParallelDims

AC_MODES = ["none", "full", "layer", "op"]


def run_layouts(tmp_path, nproc: int, layouts: list[dict],
                extra: list[dict] = ()) -> list[dict]:
    """Every layout with every checkpointing mode, then the ``extra`` runs, in one launch."""
    return run_distributed(tmp_path, nproc, [
        {**BASE, **parallel, "activation_checkpoint.mode": mode,
         "activation_checkpoint.every_n_layers": 2, "job.name": f"{i}-{mode}",
         "job.output_dir": str(tmp_path)}
        for i, parallel in enumerate(layouts) for mode in AC_MODES] + [
        {**BASE, **overrides, "job.name": f"extra-{i}", "job.output_dir": str(tmp_path)}
        for i, overrides in enumerate(extra)])


# Global batch 8 of micro-batches of 1: the 2-rank layout accumulates 4 micro-batches, the 4-rank
# ones 2, the single process 8.
@pytest.mark.parametrize("nproc, layouts", [
    (2, [{"parallel.dp_shard": 2}]),
    (4, [{"parallel.dp_shard": 4}, {"parallel.dp_replicate": 2, "parallel.dp_shard": 2}]),
], ids=["fsdp2", "fsdp4-hsdp2x2"])
def test_layout_matches_single_process(tmp_path, reference, nproc, layouts):
    # Weights kept gathered from forward to backward in every block (the auto policy's end
    # state on a roomy GPU).
    # And AdamW's update in dtrain's Triton kernel on the ranks' shards (Triton's interpreter
    # on the CPU; the folded clipping coefficient and the DTensors' local shards).
    extra = [{"parallel.dp_shard": nproc, "parallel.fsdp_reshard_after_forward": "never",
              "activation_checkpoint.mode": "op"},
             {"parallel.dp_shard": nproc, "activation_checkpoint.mode": "none",
              **({"optimizer.implementation": "triton"} if INTERPRETED else {})}]
    runs = run_layouts(tmp_path, nproc, layouts, extra)
    assert [r["overrides"]["activation_checkpoint.mode"] for r in runs] == \
        AC_MODES * len(layouts) + ["op", "none"]
    assert runs[-1]["optimizer"] == ("TritonAdamW" if INTERPRETED else "AdamW")
    for run in runs:
        label = {k: v for k, v in run["overrides"].items()
                 if k.startswith(("parallel", "act", "optimizer"))}
        assert_same_run(run, reference, str(label))


def test_activation_checkpointing_single_process_is_exact(tmp_path, reference):
    for mode in ("full", "op"):
        history = Trainer(load_config("debug", {
            **BASE, "activation_checkpoint.mode": mode,
            "job.output_dir": str(tmp_path / mode)})).train()
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
