"""``optimizer.implementation = "triton"``: AdamW's update in dtrain's Triton kernel
(``dtrain.kernels.adamw``) is torch's AdamW's, clipping and skipped steps included; its state
and checkpoints are torch's fused AdamW's; a run trains with it as with torch's fused kernel.
In Triton's interpreter on the CPU, and on a GPU where there is one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import BASE, INTERPRETED, PYTHONPATH, ROOT

from dtrain import Trainer, load_config
from dtrain.config import ConfigError
from dtrain.optim import build_optimizer, check_optimizer

# The kernel on CPU tensors runs in Triton's interpreter, which conftest turns on where there is
# no GPU (CI); on a GPU machine the CUDA cases run instead.
ON_CPU = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter: a machine without a "
                            "GPU (CI)")
DEVICES = [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


def parameters(device: str, seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    shapes = [(33, 70), (5, 3, 7), (70,)]  # sizes that are no multiple of the kernel's block
    return [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]


def optimizers(device: str, kinds: tuple[str, str]):
    from dtrain.kernels.adamw import TritonAdamW

    made = []
    for kind in kinds:
        params = parameters(device)
        groups = [{"params": params[:2], "weight_decay": 0.1},
                  {"params": params[2:], "weight_decay": 0.0}]
        options = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
        made.append(TritonAdamW(groups, **options) if kind == "triton" else
                    torch.optim.AdamW(groups, **options, fused=kind == "fused",
                                      foreach=False if kind == "fused" else None))
    return made


def step_both(pair, grads, scale=None, found_inf=None) -> None:
    for optimizer in pair:
        for p, g in zip((p for group in optimizer.param_groups for p in group["params"]), grads,
                        strict=True):
            p.grad = g.clone()
        optimizer.grad_scale, optimizer.found_inf = scale, found_inf
        optimizer.step()


def assert_same(pair) -> None:
    # The same update to fp32 rounding: torch's foreach AdamW moves the first moment by a lerp,
    # its fused kernel and this one by two products (4.5e-8 apart on moments of about 1).
    ours, theirs = pair
    for p, q in zip(*(list(o.state) for o in pair), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            # Torch's foreach AdamW keeps its step count on the host, fused ones on the device.
            torch.testing.assert_close(ours.state[p][key], theirs.state[q][key], rtol=1e-5,
                                       atol=1e-7, check_device=False)


def grads_like(pair, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn_like(p) for group in pair[0].param_groups for p in group["params"]]


@pytest.mark.parametrize("device", DEVICES)
def test_the_update_is_torch_s_adamw_with_its_decay_groups(device):
    pair = optimizers(device, ("triton", "reference"))
    start = [p.detach().clone() for group in pair[0].param_groups for p in group["params"]]
    for step in range(5):
        step_both(pair, grads_like(pair, step))
    assert_same(pair)
    assert pair[0].state_dict()["state"][0]["step"].item() == 5
    moved = [p for group in pair[0].param_groups for p in group["params"]]
    assert all(not torch.equal(p, s) for p, s in zip(moved, start, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_a_clipped_and_a_skipped_step_are_torch_s_fused_ones(device):
    # grad_scale divides the gradients (dtrain folds the clipping coefficient in), found_inf
    # leaves weights, moments and the step count as they were: both read on the device.
    pair = optimizers(device, ("triton", "fused"))
    step_both(pair, grads_like(pair, 0))
    step_both(pair, grads_like(pair, 1), scale=torch.tensor(4.0, device=device))
    assert_same(pair)
    before = [p.detach().clone() for p in pair[0].state]
    moments = [pair[0].state[p]["exp_avg"].clone() for p in pair[0].state]
    skip = torch.tensor(1.0, device=device)
    step_both(pair, [g * float("inf") for g in grads_like(pair, 2)], found_inf=skip)
    assert all(torch.equal(p, b) for p, b in zip(pair[0].state, before, strict=True))
    assert all(torch.equal(pair[0].state[p]["exp_avg"], m)
               for p, m in zip(pair[0].state, moments, strict=True))
    assert_same(pair)
    assert pair[0].state_dict()["state"][0]["step"].item() == 2


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_move_between_torch_s_fused_adamw_and_the_triton_one(device):
    pair = optimizers(device, ("triton", "fused"))
    step_both(pair, grads_like(pair, 0))
    # Swap states: each continues from the other's; both must stay in step.
    ours, theirs = pair[0].state_dict(), pair[1].state_dict()
    pair[0].load_state_dict(theirs)
    pair[1].load_state_dict(ours)
    for step in (1, 2):
        step_both(pair, grads_like(pair, step))
    assert_same(pair)


def test_auto_keeps_torch_s_fused_adamw_for_parameters_off_the_gpu():
    # A CUDA run whose parameters stay on the CPU (parallel.fsdp_cpu_offload): torch's fused
    # AdamW, which updates them there; on the CPU, foreach.
    cfg = load_config("debug", {}).optimizer
    offloaded = build_optimizer(torch.nn.Linear(8, 8), cfg, "cuda")
    assert type(offloaded) is torch.optim.AdamW and offloaded.defaults["fused"]
    on_cpu = build_optimizer(torch.nn.Linear(8, 8), cfg, "cpu")
    assert type(on_cpu) is torch.optim.AdamW and on_cpu.defaults["foreach"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_auto_takes_the_triton_kernel_on_the_gpu_unless_a_parameter_is_not_contiguous():
    from dtrain.kernels.adamw import TritonAdamW

    cfg = load_config("debug", {}).optimizer
    assert type(build_optimizer(torch.nn.Linear(8, 8).cuda(), cfg, "cuda")) is TritonAdamW
    strided = torch.nn.Linear(8, 8).cuda()
    strided.weight = torch.nn.Parameter(torch.randn(8, 8, device="cuda").t())
    optimizer = build_optimizer(strided, cfg, "cuda")
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]


@ON_CPU
def test_a_run_trains_with_it_as_with_torch_s_fused_adamw(tmp_path):
    # 6 steps of the debug model on the CPU (the clipping threshold is crossed, so the folded
    # clipping coefficient is exercised), torch's fused AdamW against the Triton kernel.
    losses = {}
    for kind in ("fused", "triton"):
        overrides = {**BASE, "optimizer.implementation": kind,
                     "job.output_dir": str(tmp_path / kind)}
        trainer = Trainer(load_config("debug", overrides))
        assert type(trainer.optimizer).__name__ == ("TritonAdamW" if kind == "triton" else "AdamW")
        losses[kind] = [r["loss"] for r in trainer.train()]
    assert losses["triton"][-1] < losses["triton"][0] - 0.3
    assert losses["triton"] == pytest.approx(losses["fused"], rel=1e-5)


def test_without_a_gpu_or_with_cpu_offload_it_is_refused_with_the_fix(tmp_path):
    cfg = load_config("debug", {"optimizer.implementation": "triton"})
    with pytest.raises(ConfigError, match="fsdp_cpu_offload keeps them on the CPU: set "
                                          "optimizer.implementation = 'auto'"):
        check_optimizer(cfg.optimizer, torch.device("cuda"), offload=True)
    # A CPU run outside the interpreter: one line naming the fix, exit status 2.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.train", "--recipe", "debug", "--training.device", "cpu",
         "--optimizer.implementation", "triton", "--job.output_dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**env, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "optimizer.implementation = 'triton' runs on CUDA; this run is on cpu: set " \
        "optimizer.implementation = 'auto'" in result.stderr
