"""AdamW groups, gradient clipping."""


import pytest
import torch

from dtrain.config import OptimizerConfig
from dtrain.models import build
from dtrain.optim import build_optimizer, clip_grad_norm_


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
