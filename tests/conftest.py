import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# On a machine without CUDA where Triton is installed (CI installs it), dtrain's Triton kernels
# run in Triton's interpreter (tests/test_kernels.py). It must be on before a kernel is defined.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Child processes import this checkout first, and whatever the parent's PYTHONPATH adds after it
# (packages installed there, as on the GPU machines).
PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def run_cli(args: list[str], nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``python -m dtrain.train ARGS`` (under torchrun when nproc > 1) and returns it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dtrain.train", *args]
    else:
        cmd = [sys.executable, "-m", "dtrain.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


# A small, fast configuration of the debug recipe for parity tests: 8 sequences of 64 tokens
# per step, 2 blocks, 4 steps (the first step's gradient norm, 1.05, crosses the clipping
# threshold of 1.0, so a wrong norm changes the later losses).
BASE = {"model.n_layers": 2, "training.seq_len": 64, "training.global_batch_size": 8,
        "training.micro_batch_size": 1, "training.steps": 4, "lr_schedule.warmup_steps": 2,
        "metrics.log_every": 1, "metrics.tensorboard": False}
# fp32 on CPU: parallel layouts differ from the single process only in the order of sums.
REL = 1e-5


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The single-process run every parallel layout is compared with."""
    from dtrain import Trainer, load_config

    out = tmp_path_factory.mktemp("ref")
    return Trainer(load_config("debug", {**BASE, "job.output_dir": str(out)})).train()


@pytest.fixture(scope="session")
def reference_4_layers(tmp_path_factory):
    """The single-process run of BASE with 4 blocks (enough for 4 pipeline stages)."""
    from dtrain import Trainer, load_config

    out = tmp_path_factory.mktemp("ref4")
    return Trainer(load_config("debug", {**BASE, "model.n_layers": 4,
                                         "job.output_dir": str(out)})).train()


def assert_same_run(run: dict, reference: list[dict], label: str) -> None:
    """Equal initial weights, and per-step losses and gradient norms within REL."""
    assert run["init_ok"] is not False, f"{label}: initial weights differ from one device's"
    assert len(run["history"]) == len(reference)
    for ref, got in zip(reference, run["history"], strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], rel=REL), (label, ref["step"])
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=REL), (label, ref["step"])


@pytest.fixture
def cli():
    return run_cli


def run_distributed(tmp_path: Path, nproc: int, specs: list[dict]) -> list[dict]:
    """Trains each override dict in ``specs`` (on the debug recipe) in one torchrun launch of
    ``nproc`` gloo processes; returns, per spec, the logged records, whether the initial weights
    equal the single-device model's, and the dtype of the first attention projection's output."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "spec.json").write_text(json.dumps(specs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", str(ROOT / "tests" / "distributed_runner.py"),
         str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


# MoE parity configuration: BASE on mixtral_debug (8 experts, top-2 softmax routing, dropless)
# with the load-balancing loss (the preset's 0.01) and a router z-loss in the gradient, 4 steps
# (the first and third clipped).
MOE = {**BASE, "model.name": "mixtral_debug", "model.moe_z_loss_coeff": 1e-3}
# A 2-block Mixtral on the CPU, 2 micro-batches a step (the experts' gradients added in place)
MIXTRAL_CPU = {"model.name": "mixtral_debug", "model.n_layers": 2, "training.device": "cpu",
               "training.seq_len": 64, "training.global_batch_size": 4,
               "training.micro_batch_size": 2, "training.steps": 4, "metrics.log_every": 1,
               "metrics.tensorboard": False}


@pytest.fixture(scope="session")
def moe_reference(tmp_path_factory):
    """The single-process MoE run expert-parallel layouts are compared with."""
    from dtrain import Trainer, load_config

    out = tmp_path_factory.mktemp("moe_ref")
    return Trainer(load_config("debug", {**MOE, "job.output_dir": str(out)})).train()


def as_if_on_gpu(monkeypatch, name: str = "NVIDIA H200",
                  capability: tuple[int, int] = (9, 0)) -> None:
    """The FP8 checks told they run on a GPU called ``name`` of compute ``capability``, with the
    FP8 backend installed (this machine may have neither)."""
    from dtrain.parallel import fp8

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(fp8, "require_backend", lambda backend: None)


def assert_like_the_emulation(name: str, got: torch.Tensor, want: torch.Tensor,
                              device: str, most_off: float = 5e-3) -> None:
    """dtrain's blockwise Triton kernels (``got``) against the emulated products (``want``):
    the same casts, products summed in another order. In Triton's interpreter (fp32 sums) only
    the order differs: values more than 1e-5 of the largest apart are a ``most_off`` share (a
    sum that tips an intermediate's e4m3 rounding, 2^-4 relative) and none is off by 2e-3 of
    the largest. Hopper's FP8 tensor cores sum each 128-wide slice with fewer bits, which tips
    more of them: on an H100 a quarter of Mixtral-like outputs moved by over 1e-5 of the
    largest and the largest move was 6.1e-3 of it (2026-12-06). So there each value is bounded
    at 2% of the largest (3x that move), and the differences as a whole at 1% of the values'
    norm: a sixth of one e4m3 step (2^-4), the rounding the recipe itself puts on every value,
    where tipped roundings are a few values' single steps."""
    scale = want.abs().max().item()
    if device == "cuda":
        spread = ((got - want).norm() / want.norm()).item()
        assert spread < 1e-2 and (got - want).abs().max() < 2e-2 * scale, (name, spread)
        return
    off = ((got - want).abs() > 1e-5 * scale).float().mean().item()
    assert off < most_off and (got - want).abs().max() < 2e-3 * scale, (name, off)


def strict_records(run_dir) -> list[dict]:
    """metrics.jsonl, refusing anything that is not strict JSON (NaN, Infinity)."""
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")
    return [json.loads(line, parse_constant=refuse)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start_cli(args: list[str]) -> subprocess.Popen:
    """``python -m dtrain.train ARGS`` in one process in the background, its output piped (with
    Python's fault handler on: ``finish`` reads its threads' stacks if it does not end)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH,
           "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen([sys.executable, "-m", "dtrain.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finish(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``process.communicate(timeout)``; a process still running then fails the test with the
    Python stacks of its threads (SIGABRT makes the fault handler print them)."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, err = process.communicate(timeout=60)
        raise AssertionError(f"still running after {timeout:.0f} s; its threads' stacks:\n"
                             f"{err[-8000:]}") from None


def torchrun(args: list[str], nproc: int = 2, launch: tuple[str, ...] = ("--standalone",),
             **popen) -> subprocess.Popen:
    """``torchrun LAUNCH --nproc_per_node=NPROC -m dtrain.train ARGS``, its output piped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}",
         "--monitor-interval", "1", "-m", "dtrain.train", *args],
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env,
           "cwd": ROOT, **popen})


def cli_args(overrides: dict) -> list[str]:
    """``--key value`` arguments of the debug recipe with ``overrides``."""
    args = ["--recipe", "debug"]
    for key, value in overrides.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def wait_for_step(process: subprocess.Popen, step: int, lines: list[str]) -> None:
    """Reads the run's console until the line of ``step`` (kept in ``lines``)."""
    for line in process.stdout:
        lines.append(line)
        if (match := re.match(r"step +(\d+)/", line)) and int(match.group(1)) >= step:
            return
    tail = "".join(lines[-20:])
    raise AssertionError(f"the run ended before step {step}:\n{tail}")


def rank_pid(parent: int, rank: int) -> int:
    """The worker process of ``rank`` under the torchrun process ``parent``."""
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True,
                              text=True).stdout.split()
    for child in children:
        environ = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under {parent}")


@contextlib.contextmanager
def tmpfs(folder: Path, options: str):
    """A tmpfs mounted at ``folder`` (made if missing) with mount ``options`` ("size=64M",
    "size=1M,ro"), unmounted after (lazily: a run's lock file may still be open there, and a
    test may have stacked a second mount). Skips the test where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                            str(folder)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield folder
    finally:
        while subprocess.run(["umount", "--lazy", str(folder)],
                             capture_output=True).returncode == 0:
            pass


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs: room for one checkpoint of the 2-block debug model (43 MB), not two."""
    with tmpfs(tmp_path / "disk", "size=64M") as mount:
        yield mount


def with_biases_and_norms_drawn(model):
    """``model`` with its biases and norm weights drawn away from 0 and 1 (the same on every
    rank, seed 1), so that a misplaced bias or norm weight changes the result."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
    return model


def assert_converted_model_initialises_as_built(convert, unwrap=lambda weight: weight) -> None:
    """A 2-block debug model built on the meta device and converted by ``convert(model)`` (FP8
    layers), then allocated and initialised, holds the same parameters, by the same names, as
    the model built plain from that seed: bit for bit (``unwrap``: a weight's plain tensor)."""
    import torch

    from dtrain.models import build

    model = build("llama3_debug", device="meta", n_layers=2)
    convert(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    reference = build("llama3_debug", device="cpu", seed=3, n_layers=2).state_dict()
    got = model.state_dict()
    assert list(got) == list(reference)
    for name, want in reference.items():
        assert torch.equal(unwrap(got[name]), want), name


def logits_and_grads(model, vocab: int = 128):
    """Logits and gradients (gathered whole) of one forward and backward of ``model`` on a fixed
    batch of 2 x 16 tokens."""
    import torch
    import torch.nn.functional as F

    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return logits.detach(), {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                                    else p.grad) for name, p in model.named_parameters()}


def gloo_rank(rank: int, port: int, worker, args: tuple) -> None:
    """One of ``on_two_gloo_ranks``' processes: joins the group, runs ``worker(rank, *args)``,
    meets the other rank, then leaves without gloo's teardown, which now and then aborts a
    process after the work is done ("terminate called without an active exception")."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    worker(rank, *args)
    dist.barrier()
    os._exit(0)


def on_two_gloo_ranks(worker, *args) -> None:
    """Runs ``worker(rank, *args)`` (a module-level function) on ranks 0 and 1 of a gloo group
    of two spawned processes; returns when both are done."""
    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(gloo_rank, args=(port, worker, args), nprocs=2)
