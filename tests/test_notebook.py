"""The documented notebook (examples/notebook.ipynb) run cell by cell in a real Jupyter kernel:
train(until), train() again, extend(), the records each call returns."""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is a [dev] extra")
nbclient = pytest.importorskip("nbclient", reason="nbclient is a [dev] extra")
pytest.importorskip("ipykernel", reason="ipykernel is a [dev] extra")

NOTEBOOK = Path(__file__).parent.parent / "examples" / "notebook.ipynb"


def kernel_for_this_python(folder: Path, monkeypatch) -> str:
    """A kernel spec that starts this interpreter with this checkout's dtrain, found through
    JUPYTER_PATH: the spec ipykernel installs names whatever ``python`` is on PATH."""
    spec = folder / "kernels" / "dtrain-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dtrain test", "language": "python",
        "env": {"PYTHONPATH": str(NOTEBOOK.parent.parent)}}))  # this checkout's dtrain
    monkeypatch.setenv("JUPYTER_PATH", str(folder))
    return "dtrain-test"


def require_a_kernel(name: str) -> None:
    """Skips, saying why, where a kernel cannot start on this machine (no sockets, say)."""
    from jupyter_client import KernelManager

    manager = KernelManager(kernel_name=name)
    try:
        manager.start_kernel()
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=120)
        client.stop_channels()
    except Exception as error:
        pytest.skip(f"a Jupyter kernel cannot start here: {type(error).__name__}: {error}")
    finally:
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)


def outputs(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream"
                   and o.name == "stdout")


def test_the_documented_notebook_runs_in_a_real_kernel(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source += (f"\nsteps = 8\noutput_dir = {str(tmp_path)!r}\n"
                      'settings = {"model.n_layers": 1, "training.seq_len": 32, '
                      '"training.global_batch_size": 4, "metrics.log_every": 1, '
                      '"metrics.tensorboard": False, "lr_schedule.warmup_steps": 1}')
    kernel = kernel_for_this_python(tmp_path / "jupyter", monkeypatch)
    require_a_kernel(kernel)
    client = nbclient.NotebookClient(nb, timeout=300, startup_timeout=120, kernel_name=kernel,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # a failing cell raises with its traceback
    # Per code cell, what it printed: dtrain's own lines (the start-up summary, a line per
    # step, the done line), then the notebook's prints.
    _, built, first, rest, more, _ = [outputs(c).splitlines() for c in nb.cells
                                      if c.cell_type == "code"]
    assert built[0].startswith("notebook: llama3_debug, 2.8M parameters | world 1 (cpu)")
    assert [line.split(" |")[0] for line in first] == [
        "step 1/8", "step 2/8", "step 3/8", "step 4/8", first[-1]]
    assert first[-1].startswith("stopped at step 4 loss ")
    assert rest[0].startswith("parameters ") and rest[-1].startswith("finished at step 8 loss ")
    assert rest[-2].startswith("done: steps 5-8 in ")
    assert more[0] == ("extended to 10 steps: steps 9-10 train at lr 0.0003, the schedule's end "
                       "(its decay ends at step 8)")
    assert more[-2:] == ["extended to step 10 lr 0.0003", "records in all 10"]
    records = [json.loads(line) for line in
               (tmp_path / "notebook" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))
