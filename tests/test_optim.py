"""Learning-rate schedules at chosen steps, AdamW groups, gradient clipping."""

import math

import pytest
import torch

from dtrain.config import LRScheduleConfig, OptimizerConfig
from dtrain.models import build
from dtrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, lr_factor
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
    sched = build_lr_scheduler(opt, LRScheduleConfig(warmup_steps=4, decay="constant"), 10, PEAK)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([PEAK * f for f in (0.25, 0.5, 0.75, 1.0, 1.0)])


def test_weight_decay_only_on_matrices():
    model = build("llama3_debug", device="cpu", seed=0)
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1), "cpu")
    decayed, plain = opt.param_groups
    assert all(p.ndim == 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_clip_grad_norm_returns_total_norm_and_scales_to_max():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.cat([a.grad, b.grad]).norm()
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def test_clip_disabled_with_zero_max_norm():
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([30.0, 40.0])
    assert clip_grad_norm_([a], max_norm=0.0).item() == pytest.approx(50.0)
    assert torch.equal(a.grad, torch.tensor([30.0, 40.0]))


@pytest.mark.parametrize("max_norm", [0.5, 100.0, 0.0])  # clipping, not reached, disabled
def test_fused_adamw_takes_the_clip_inside_its_step(max_norm):
    """With fused AdamW the clip is the optimizer's gradient scale, not a pass over the
    gradients: the gradients stay as they are and the update equals clip-then-step."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32), torch.randn(32)]
    # Norms that differ step to step (Adam's update ignores one constant scale on every step).
    steps = [[torch.randn(64, 32) * k, torch.randn(32) * k] for k in (0.01, 3.0, 0.3)]
    results = []
    for impl in ("fused", "foreach"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = build_optimizer(torch.nn.ParameterList(params),
                              OptimizerConfig(weight_decay=0.1, implementation=impl), "cpu")
        for grads in steps:
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            norm = clip_grad_norm_(params, max_norm=max_norm, optimizer=opt)
            assert norm.item() == pytest.approx(torch.cat([g.flatten() for g in grads]).norm()
                                                .item(), rel=1e-6)
            if impl == "fused":  # the gradients are left unscaled
                assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
                assert (opt.grad_scale is None) == (max_norm == 0)
            opt.step()
        results.append(params)
    # The fused step divides by 1 / coefficient where the clip multiplies by the coefficient:
    # the two round differently in the last bit; fp32 rounding over 3 steps stays below 1e-6.
    for fused, foreach in zip(*results, strict=True):
        torch.testing.assert_close(fused, foreach, rtol=1e-6, atol=1e-7)


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
    from dtrain import Trainer, load_config

    Trainer(load_config("debug", {"training.steps": 20, "model.n_layers": 1,
                                  "job.output_dir": str(tmp_path)}))
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("batch: "))
    assert line.endswith("| 20 steps | lr 0.003 to 0.0003 (cosine), 20 warm-up steps (the "
                         "warm-up covers all 20 steps: the learning rate never reaches its peak; "
                         "lower lr_schedule.warmup_steps)")
