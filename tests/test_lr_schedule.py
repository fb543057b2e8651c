"""The learning-rate schedule: its shape at chosen steps, its floor and decay end, a finished
trainer given more steps, a resume under another schedule."""

import math

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.config import ConfigError, LRScheduleConfig
from dtrain.lr_schedule import LRSchedule, lr_factor
from dtrain.train import main

PEAK = 1e-3


def factors(cfg: LRScheduleConfig, total: int) -> dict[int, float]:
    return {s: lr_factor(s, cfg, total, PEAK) for s in range(1, total + 1)}


def test_linear_warmup_then_cosine_to_min_lr():
    cfg = LRScheduleConfig(warmup_steps=10, decay="cosine", min_lr=1e-4)
    f = factors(cfg, 110)
    assert f[1] == pytest.approx(0.1) and f[5] == pytest.approx(0.5) and f[10] == 1.0
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f[35] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert f[110] == pytest.approx(0.1)


def test_linear_decay():
    f = factors(LRScheduleConfig(warmup_steps=0, decay="linear", min_lr=0.0), 100)
    assert f[1] == pytest.approx(0.99) and f[50] == pytest.approx(0.5) and f[100] == 0.0


def test_constant_after_warmup():
    f = factors(LRScheduleConfig(warmup_steps=4, decay="constant", min_lr=1e-4), 50)
    assert f[2] == 0.5 and f[4] == 1.0 and f[50] == 1.0


@pytest.mark.parametrize("shape, at_half", [("linear", 0.5), ("cosine", 0.5),
                                            ("sqrt", 1 - math.sqrt(0.5))])
def test_wsd_holds_then_decays_over_last_fraction(shape, at_half):
    cfg = LRScheduleConfig(warmup_steps=10, decay="wsd", min_lr=0.0, wsd_decay_fraction=0.2,
                           wsd_decay_shape=shape)
    f = factors(cfg, 100)
    assert f[10] == 1.0 and f[50] == 1.0 and f[80] == 1.0
    assert f[90] == pytest.approx(at_half)
    assert f[100] == pytest.approx(0.0)


def test_scheduler_applies_factor_of_the_step_being_taken():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=PEAK)
    sched = LRSchedule(opt, LRScheduleConfig(warmup_steps=4, decay="constant"), 10, PEAK)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([PEAK * f for f in (0.25, 0.5, 0.75, 1.0, 1.0)])


def test_a_floor_above_the_peak_is_refused_naming_both(capsys):
    # The debug recipe's min_lr is 3e-4: a peak of 1e-4 would make the "decay" climb to 3x it.
    assert main(["--recipe", "debug", "--optimizer.lr", "1e-4", "--dry-run",
                 "--dry-run-world-size", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: lr_schedule.min_lr = 0.0003 is above optimizer.lr = 0.0001: the cosine decay "
        "would climb from the peak to it; set lr_schedule.min_lr at or below optimizer.lr (e.g. "
        "--lr_schedule.min_lr 1e-05, a tenth of it)"]


def test_the_start_line_shows_peak_floor_and_warm_up_and_a_warm_up_longer_than_the_run(
        tmp_path, capsys):
    Trainer(load_config("debug", {"training.steps": 20, "model.n_layers": 1,
                                  "job.output_dir": str(tmp_path)}))
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("batch: "))
    assert line.endswith("| 20 steps | lr 0.003 to 0.0003 (cosine), 20 warm-up steps (the "
                         "warm-up covers all 20 steps: the learning rate never reaches its peak; "
                         "lower lr_schedule.warmup_steps)")


@pytest.mark.parametrize("decay", ["cosine", "linear", "wsd"])
def test_the_decay_ends_at_decay_steps_and_the_steps_after_stay_at_the_floor(decay):
    cfg = LRScheduleConfig(warmup_steps=2, decay=decay, min_lr=1e-4, decay_steps=10)
    f = factors(cfg, 30)
    assert f[10] == pytest.approx(0.1) and f[11] == pytest.approx(0.1)
    assert f[30] == pytest.approx(0.1)
    assert all(f[s] >= f[s + 1] - 1e-12 for s in range(2, 30))  # never climbs after the peak
    # Without decay_steps the same schedule over 10 steps: the first ten equal.
    short = factors(LRScheduleConfig(warmup_steps=2, decay=decay, min_lr=1e-4), 10)
    assert [f[s] for s in range(1, 11)] == pytest.approx(list(short.values()))


TINY = {"model.n_layers": 1, "training.seq_len": 32, "training.global_batch_size": 4,
        "metrics.tensorboard": False, "metrics.log_every": 1, "lr_schedule.warmup_steps": 1,
        "checkpoint.enabled": True, "checkpoint.interval": 100}


def test_a_finished_trainer_extended_trains_the_added_steps_at_the_floor(tmp_path, capsys):
    trainer = Trainer(load_config("debug", {**TINY, "training.steps": 4,
                                            "job.output_dir": str(tmp_path)}))
    first = trainer.train()
    trainer.extend(2)
    more = trainer.train()
    trainer.close()
    reference = Trainer(load_config("debug", {**TINY, "training.steps": 4,
                                              "job.output_dir": str(tmp_path / "ref")}))
    assert [r["lr"] for r in first] == [r["lr"] for r in reference.train()]  # unchanged
    reference.close()
    assert [r["step"] for r in more] == [5, 6]
    assert [r["lr"] for r in more] == pytest.approx([3e-4, 3e-4])  # the recipe's min_lr
    out = capsys.readouterr().out
    assert ("extended to 6 steps: steps 5-6 train at lr 0.0003, the schedule's end (its decay "
            "ends at step 4)") in out
    folder = tmp_path / "debug"
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == [
        "step-0000004", "step-0000006"]  # the new last step is saved
    config = (folder / "config.toml").read_text()
    assert "steps = 6" in config and "decay_steps = 4" in config
    with pytest.raises(ConfigError, match=r"extend\(0\): give a number of steps >= 1"):
        trainer.extend(0)


def test_a_resume_under_another_schedule_is_refused_naming_the_decay_end_to_keep(tmp_path,
                                                                                   capsys):
    base = {**TINY, "job.output_dir": str(tmp_path)}
    trainer = Trainer(load_config("debug", {**base, "training.steps": 4}))
    trainer.train()
    trainer.close()
    # More steps from the command line: the cosine would stretch and climb back from its floor.
    args = ["--recipe", "debug", *[f"--{k}={v}" for k, v in base.items()]]
    assert main([*args, "--training.steps", "6"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: the checkpoint's learning-rate schedule differs from this run's (decay_end was "
        "4 and is now 6): the learning rate of the steps resumed would not be the schedule's it "
        "began (to train past the end of the decay at its floor, keep its end: "
        "--lr_schedule.decay_steps 4); set the settings back, or set "
        "lr_schedule.override_checkpoint = true to continue under the new schedule from the "
        "step resumed"]
    resumed = Trainer(load_config("debug", {**base, "training.steps": 6,
                                            "lr_schedule.decay_steps": 4}))
    assert resumed.step == 4
    assert "taken over" not in capsys.readouterr().out  # the refused launch freed the folder
    assert [r["lr"] for r in resumed.train()] == pytest.approx([3e-4, 3e-4])
    resumed.close()
    # A new peak taken on purpose: said, and the next step runs under it.
    new = Trainer(load_config("debug", {**base, "training.steps": 8, "optimizer.lr": 1e-3,
                                        "lr_schedule.min_lr": 1e-4,
                                        "lr_schedule.override_checkpoint": True}))
    assert "lr_schedule.override_checkpoint: the schedule continues under this run's settings" \
        in capsys.readouterr().out
    records = new.train()
    new.close()
    expected = [1e-3 * lr_factor(s, new.config.lr_schedule, 8, 1e-3) for s in (7, 8)]
    assert [r["lr"] for r in records] == pytest.approx(expected)


def test_steps_after_the_decay_end_are_at_the_floor_even_within_a_longer_warm_up():
    # An 8-step run inside a 20-step warm-up, extended: the steps added are at min_lr, as said.
    cfg = LRScheduleConfig(warmup_steps=20, decay="cosine", min_lr=1e-4, decay_steps=8)
    f = factors(cfg, 10)
    assert f[8] == pytest.approx(8 / 20) and f[9] == f[10] == pytest.approx(0.1)
