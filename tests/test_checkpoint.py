"""Distributed checkpoints: exact resume, resharding across layouts, crash safety, bad input."""

import shutil

import pytest
import torch
from conftest import BASE, REL, run_distributed

from dtrain import Trainer, load_config
from dtrain.checkpoint import Checkpointer, checkpoint_steps
from dtrain.config import ConfigError

CKPT = {**BASE, "checkpoint.enabled": True, "checkpoint.interval": 5}


def trainer(tmp_path, steps: int, **overrides) -> Trainer:
    return Trainer(load_config("debug", {**CKPT, "training.steps": steps,
                                         "job.output_dir": str(tmp_path), **overrides}))


@pytest.fixture(scope="module")
def continuous(tmp_path_factory):
    """10 uninterrupted steps, no checkpoints: what every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("continuous")
    return Trainer(load_config("debug", {**BASE, "training.steps": 10,
                                         "job.output_dir": str(out)})).train()


def losses(history):
    return [r["loss"] for r in history]


@pytest.mark.parametrize("async_save", [False, True])
def test_resume_continues_bitwise(tmp_path, async_save):
    # fp32 on one CPU process: the resumed run does exactly the same arithmetic.
    reference = Trainer(load_config("debug", {**BASE, "training.steps": 20,
                                              "job.output_dir": str(tmp_path / "ref")})).train()
    first = trainer(tmp_path, 20, **{"checkpoint.async_save": async_save}).train(until=10)
    resumed = trainer(tmp_path, 20, **{"checkpoint.async_save": async_save})
    assert resumed.step == 10
    assert losses(first) + losses(resumed.train()) == losses(reference)
    assert checkpoint_steps(tmp_path / "debug" / "checkpoints") == [10, 15, 20]


def test_resume_restores_the_random_generator(tmp_path, monkeypatch):
    save = Checkpointer.save

    def save_after_drawing(self, step):
        torch.rand(16)  # moves the generator away from its seeded state before the save
        save(self, step)

    monkeypatch.setattr(Checkpointer, "save", save_after_drawing)
    trainer(tmp_path, 10).train(until=5)
    saved = torch.get_rng_state()
    monkeypatch.undo()
    resumed = trainer(tmp_path, 10)  # seeds from training.seed, then loads the checkpoint
    assert resumed.step == 5
    assert torch.equal(torch.get_rng_state(), saved)
    torch.manual_seed(resumed.config.training.seed)
    assert not torch.equal(torch.get_rng_state(), saved)


def test_keep_last_and_load_step(tmp_path):
    trainer(tmp_path, 20, **{"checkpoint.keep_last": 2}).train()
    folder = tmp_path / "debug" / "checkpoints"
    assert checkpoint_steps(folder) == [15, 20]
    with pytest.raises(ConfigError, match="load_step = 5 not found .* available steps are 15, 20"):
        trainer(tmp_path, 20, **{"checkpoint.load_step": 5})
    assert trainer(tmp_path, 20, **{"checkpoint.load_step": 15}).step == 15
    assert checkpoint_steps(folder) == [15]  # step 20's branch moved aside (test_run_safety)


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch, continuous):
    trainer(tmp_path, 10).train(until=5)

    def crash(*args):
        raise RuntimeError("killed while saving")

    # The shards are written; the process dies before the folder is renamed.
    monkeypatch.setattr("dtrain.checkpoint.write_hashes", crash)
    with pytest.raises(RuntimeError, match="killed"):
        trainer(tmp_path, 10).train()  # its save at step 10 dies after writing shards
    monkeypatch.undo()
    folder = tmp_path / "debug" / "checkpoints"
    assert (folder / "step-0000010.tmp").is_dir() and checkpoint_steps(folder) == [5]
    resumed = trainer(tmp_path, 10)
    assert resumed.step == 5
    after = resumed.train()
    assert losses(after) == pytest.approx(losses(continuous)[5:], rel=REL)


def test_damaged_checkpoint_is_one_clear_error(tmp_path):
    trainer(tmp_path, 5).train()
    step = tmp_path / "debug" / "checkpoints" / "step-0000005"
    shard = next(step.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"checkpoint .*step-0000005 cannot be loaded"):
        trainer(tmp_path, 10)


def test_checkpoint_of_another_model_shape_is_refused(tmp_path):
    trainer(tmp_path, 5).train()
    with pytest.raises(ConfigError, match="cannot be loaded.*another model shape"):
        trainer(tmp_path, 10, **{"model.n_layers": 3})


def test_missing_shard_is_refused(tmp_path):
    trainer(tmp_path, 5).train()
    step = tmp_path / "debug" / "checkpoints" / "step-0000005"
    next(step.glob("*.distcp")).unlink()
    with pytest.raises(ConfigError, match="cannot be loaded"):
        trainer(tmp_path, 10)


def resharded(tmp_path, before: tuple[int, dict], after: tuple[int, dict]) -> list[dict]:
    """Trains 5 steps under one layout, then resumes to 10 under another."""
    common = {**CKPT, "job.output_dir": str(tmp_path), "job.name": "run"}
    run_distributed(tmp_path / "a", before[0], [{**common, **before[1],
                                                 "training.steps": 10, "_until": 5}])
    (run,) = run_distributed(tmp_path / "b", after[0], [{**common, **after[1],
                                                         "training.steps": 10}])
    return run["history"]


def test_fsdp4_resumes_as_tp2_x_fsdp2(tmp_path, continuous):
    # Also another data-parallel degree (4 -> 2) for the loader.
    history = resharded(tmp_path, (4, {"parallel.dp_shard": 4}),
                        (4, {"parallel.tp": 2, "parallel.dp_shard": 2}))
    assert losses(history) == pytest.approx(losses(continuous)[5:], rel=REL)


def test_pipeline_resumes_without_pipeline_on_more_data_ranks(tmp_path, continuous):
    history = resharded(tmp_path, (2, {"parallel.pp": 2, "parallel.dp_shard": 1}),
                        (2, {"parallel.dp_shard": 2}))
    assert losses(history) == pytest.approx(losses(continuous)[5:], rel=REL)


def test_rerun_after_finishing_does_nothing_more(tmp_path):
    trainer(tmp_path, 5).train()
    again = trainer(tmp_path, 5)
    assert again.step == 5 and again.train() == []
    shutil.rmtree(tmp_path / "debug" / "checkpoints")
    with pytest.raises(ConfigError, match="already holds a run's metrics"):
        trainer(tmp_path, 5)  # a new run over the old one's metrics (test_run_safety)
    assert trainer(tmp_path, 5, **{"job.overwrite": True}).step == 0


def test_expert_parallel_2_resumes_as_expert_parallel_4(tmp_path, moe_reference):
    # The experts' [n_experts, ...] tensors are saved whole: 4 experts per rank, then 2.
    from conftest import MOE

    common = {**MOE, "checkpoint.enabled": True, "checkpoint.interval": 2,
              "job.output_dir": str(tmp_path), "job.name": "run"}
    run_distributed(tmp_path / "a", 2, [{**common, "parallel.ep": 2, "_until": 2}])
    (run,) = run_distributed(tmp_path / "b", 4, [{**common, "parallel.ep": 4}])
    assert [r["step"] for r in run["history"]] == [3, 4]
    assert losses(run["history"]) == pytest.approx(losses(moe_reference)[2:], rel=REL)


class CountingLinear(torch.nn.Linear):
    """A linear layer with an extra state whose size changes as it trains, as Transformer
    Engine's FP8 linears serialise their scaling state (a uint8 tensor, ``_extra_state``)."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return torch.arange(self.calls, dtype=torch.int64).to(torch.uint8)

    def set_extra_state(self, state):
        self.calls = state.numel()


def with_extra_state(monkeypatch):
    """Builds every run's wq layers as ``CountingLinear``."""
    import dtrain.run

    build = dtrain.run.build_model

    def build_counting(*args, **kwargs):
        built = build(*args, **kwargs)
        for part in built.parts:
            for name, module in part.named_modules():
                if name.endswith("attention.wq"):
                    module.__class__ = CountingLinear
        return built

    monkeypatch.setattr(dtrain.run, "build_model", build_counting)


def wq_calls(run: Trainer) -> list[int]:
    return [m.calls for m in run.model.modules() if isinstance(m, CountingLinear)]


def test_extra_states_resume_and_checkpoints_load_across_layouts_with_and_without(
        tmp_path, monkeypatch):
    # A layout whose modules have extra states (TE's FP8 linears) saves them beside the model
    # and resumes them, though their size differs from a fresh model's (DCP alone refuses).
    with_extra_state(monkeypatch)
    first = trainer(tmp_path / "te", 10)
    first.train(until=5)
    assert wq_calls(first) == [5 * 8] * 2  # 8 micro-batches a step
    resumed = trainer(tmp_path / "te", 10)
    assert resumed.step == 5 and wq_calls(resumed) == [40, 40]
    weights = {k: v.clone() for k, v in first.model.state_dict().items()
               if not k.endswith("_extra_state")}
    monkeypatch.undo()
    # Its checkpoint loads into the plain layout (torchao's and bf16's: no extra states) ...
    plain = trainer(tmp_path / "te", 10)
    assert plain.step == 5 and not wq_calls(plain)
    assert all(torch.equal(v, weights[k]) for k, v in plain.model.state_dict().items())
    assert len(losses(plain.train())) == 5
    # ... and a plain checkpoint into the layout with extra states, which keep their own.
    trainer(tmp_path / "bf16", 10).train(until=5)
    with_extra_state(monkeypatch)
    from_plain = trainer(tmp_path / "bf16", 10)
    assert from_plain.step == 5 and wq_calls(from_plain) == [0, 0]
    assert len(losses(from_plain.train())) == 5 and wq_calls(from_plain) == [40, 40]
