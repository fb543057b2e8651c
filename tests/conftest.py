import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs ``python -m dtrain.train ARGS`` (under torchrun when nproc > 1) and returns it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dtrain.train", *args]
    else:
        cmd = [sys.executable, "-m", "dtrain.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture
def cli():
    return run_cli
