"""Expert parallel over gloo reproduces the single-process MoE run (fp32, dropless): equal initial
weights, per-step losses, gradient norms and aux losses within 1e-5 relative over 5 steps, for
EP 2, EP 4, EP 2 x FSDP 2 (with activation checkpointing), PP 2 x EP 2 and EP 2 x TP 2."""

import pytest
from conftest import MOE, REL, assert_same_run, run_distributed

from dtrain import Trainer, load_config
from dtrain.config import ConfigError, ParallelConfig
from dtrain.models import build
from dtrain.parallel.dims import ParallelDims
from dtrain.parallel.expert import check_ep

# Under TP each rank routes its own sequence shard, so the load-balancing loss (a product of
# sums over a micro-batch's tokens) is computed per shard: the TP layout is compared with a run
# without it (the z-loss, a mean over tokens, is the same either way).
NO_AUX = {"model.moe_aux_loss_coeff": 0.0}


def specs(tmp_path, layouts: list[dict]) -> list[dict]:
    return [{**MOE, **layout, "job.name": f"run{i}", "job.output_dir": str(tmp_path)}
            for i, layout in enumerate(layouts)]


def assert_same_moe_run(run: dict, reference: list[dict], label: str) -> None:
    assert_same_run(run, reference, label)
    for ref, got in zip(reference, run["history"], strict=True):
        if "aux_loss" not in got:  # a pipeline's first step (see Trainer.train)
            assert "pp" in label and ref["step"] == 1, label
            continue
        assert got["aux_loss"] == pytest.approx(ref["aux_loss"], rel=REL), (label, ref["step"])
        assert got["moe/layer0/tokens_per_expert"] == pytest.approx(
            ref["moe/layer0/tokens_per_expert"], rel=REL)


def test_expert_parallel_over_two_ranks(tmp_path, moe_reference):
    (run,) = run_distributed(tmp_path, 2, specs(tmp_path, [{"parallel.ep": 2}]))
    assert_same_moe_run(run, moe_reference, "ep2")


def test_expert_parallel_layouts_over_four_ranks(tmp_path, moe_reference):
    without_aux = Trainer(load_config("debug", {
        **MOE, **NO_AUX, "job.output_dir": str(tmp_path / "ref")})).train()
    layouts = [
        {"parallel.ep": 4},
        # Each expert's weights also FSDP-sharded over the 2 data ranks outside ep.
        {"parallel.ep": 2, "parallel.dp_shard": 4, "activation_checkpoint.mode": "full"},
        {"parallel.ep": 2, "parallel.pp": 2, "parallel.dp_shard": 2},
        {"parallel.ep": 2, "parallel.tp": 2, "parallel.dp_shard": 2, **NO_AUX},
    ]
    runs = run_distributed(tmp_path, 4, specs(tmp_path, layouts))
    for run, layout in zip(runs[:3], layouts, strict=False):
        assert_same_moe_run(run, moe_reference, str(layout))
    assert_same_run(runs[3], without_aux, "ep2 x tp2")


def test_expert_parallel_needs_an_moe_model_whose_experts_divide():
    with pytest.raises(ConfigError, match="parallel.ep = 2 needs a mixture-of-experts model"):
        check_ep(build("llama3_debug", device="meta"), 2)
    with pytest.raises(ConfigError, match="parallel.ep = 3 does not divide the model's 8 experts"):
        check_ep(build("mixtral_debug", device="meta"), 3)


def test_expert_parallel_takes_whole_context_parallel_groups():
    with pytest.raises(ConfigError, match="parallel.ep=2 must be a multiple of cp=4"):
        ParallelDims.from_config(ParallelConfig(cp=4, ep=2), 8)
    dims = ParallelDims.from_config(ParallelConfig(cp=2, ep=4), 8)
    assert (dims.dp_shard, dims.cp, dims.ep) == (4, 2, 4)
