"""The command line: exit code 2 and one clear line for bad input; --print-config; --help."""

import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios

import pytest
from conftest import PYTHONPATH, ROOT

from dtrain.config import load_config
from dtrain.train import main


@pytest.mark.parametrize("args, message", [
    (["--recipe", "debug", "--training.step", "3"], "unknown key 'training.step'"),
    (["--recipe", "missing_recipe"], "recipe 'missing_recipe' not found"),
    (["--recipe", "debug", "--training.global_batch_size", "6", "--training.micro_batch_size",
      "4"], "training.global_batch_size = 6 is not divisible by"),
    (["--recipe", "debug", "--data.path", "/nonexistent.jsonl"], "data.path: file"),
    (["--recipe", "debug", "--training.seq_len", "4096"], "exceeds the model's max_seq_len"),
    (["--recipe", "debug", "--parallel.tp", "2"], "do not divide the world size 1"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main(args) == 2  # what `python -m dtrain.train` exits with
    stderr = capsys.readouterr().err
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_bad_input_from_the_shell_exits_2_without_a_traceback(cli):
    result = cli(["--recipe", "debug", "--training.step", "3"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown key 'training.step'" in lines[0]


def test_print_config_prints_resolved_config_and_exits(cli):
    result = cli(["--recipe", "debug", "--training.steps", "3", "--print-config"])
    assert result.returncode == 0
    assert "[training]\nsteps = 3\n" in result.stdout
    assert "| loss " not in result.stdout  # nothing trained: no step lines


def test_help_lists_config_fields(cli):
    result = cli(["--help"])
    assert result.returncode == 0
    assert "--optimizer.lr (float" in result.stdout and "Peak learning rate" in result.stdout


@pytest.mark.parametrize("command", [[sys.executable, "-m", "dtrain.train"], ["dtrain-train"]])
def test_help_into_a_pipe_that_closes_early_ends_quietly_and_names_the_command(command):
    if command == ["dtrain-train"] and shutil.which("dtrain-train") is None:
        pytest.skip("dtrain-train is installed by pip install -e . (CI does)")
    # `| head -1`: the reader closes the pipe after one line, the help goes on writing.
    help_ = subprocess.Popen([*command, "--help"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": PYTHONPATH})
    first = help_.stdout.readline().decode()
    help_.stdout.close()
    assert help_.wait(timeout=60) == 0
    assert help_.stderr.read() == b""
    shown = "dtrain-train" if command == ["dtrain-train"] else "python -m dtrain.train"
    assert first.startswith(f"usage: {shown} [--recipe RECIPE]")


def test_planner_help_gives_every_option_a_text_and_its_default():
    result = subprocess.run([sys.executable, "-m", "dtrain.plan", "--help"], capture_output=True,
                            text=True, cwd=ROOT)
    text = " ".join(result.stdout.split())
    for option, default in [("--gpus-per-node GPUS_PER_NODE GPUs per machine", "8"),
                            ("--gpu-memory-gb GPU_MEMORY_GB memory of one GPU", "80.0"),
                            ("--seq-len SEQ_LEN tokens per sequence", "the recipe's, else 8192"),
                            ("--global-batch GLOBAL_BATCH sequences per optimizer step",
                             "the recipe's"),
                            ("--top TOP layouts to print", "10")]:
        assert option in text and f"(default: {default})" in text.split(option)[1][:300], option
    assert "--gpus GPUS GPUs in the whole job" in text
    assert "--recipe RECIPE" in text and "--layout LAYOUT" in text


def rank_errors(tmp_path, args: list[str]) -> tuple[list[list[str]], str]:
    """Runs ``dtrain.train ARGS`` under torchrun with two CPU ranks whose output goes to a file
    each, with c10d's INFO log on (process-group setup then logs its store connections); returns
    each rank's stderr lines and torchrun's own output. torchrun polls its workers every 10 s, so
        both have exited by themselves when it looks (not stopped by it after the first one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH,
           "TORCH_CPP_LOG_LEVEL": "INFO"}
    logs = tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "--monitor-interval", "10", "--log-dir", str(logs), "--redirects", "3",
         "-m", "dtrain.train", "--recipe", "debug", "--job.output_dir", str(tmp_path / "out"),
         *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode != 0
    files = sorted(logs.glob("*/attempt_0/*/stderr.log"), key=lambda p: int(p.parent.name))
    return [f.read_text().splitlines() for f in files], result.stderr


def test_config_error_under_torchrun_comes_before_any_process_group_on_every_rank(tmp_path):
    ranks, launcher = rank_errors(tmp_path / "tp", ["--parallel.tp", "3"])
    assert len(ranks) == 2
    for lines in ranks:
        assert lines and lines[0].startswith("error: parallel degrees"), lines[:3]
        assert len(lines) == 1, lines  # no c10d line: no store, no process group
    assert launcher.count("exitcode  : 2 ") == 2  # each rank exits 2
    # The same log shows a process group when one is set up: a missing data file is found
    # after it (by the loader), and c10d's store connection comes first.
    ranks, _ = rank_errors(tmp_path / "data", ["--data.path", "/nonexistent.jsonl"])
    for lines in ranks:
        assert "[c10d]" in lines[0] and lines[-1].startswith("error: data.path: file"), lines


# ---- the console of a run ------------------------------------------------------------------

RUN = ["--recipe", "debug", "--model.n_layers", "2", "--training.seq_len", "64",
       "--training.global_batch_size", "4", "--training.steps", "6", "--metrics.log_every", "3"]


def test_a_run_starts_with_a_short_summary_and_ends_with_one_line(cli, tmp_path):
    result = cli([*RUN, "--checkpoint.enabled", "true", "--checkpoint.interval", "3",
                  "--job.output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    start = lines[:next(i for i, line in enumerate(lines) if line.startswith("step "))]
    assert len(start) <= 8, start  # not the resolved config: that is in config.toml
    assert start[0].startswith("debug: llama3_debug, ") and "world 1 (cpu): one rank" in start[0]
    assert start[1].startswith("batch: 4 sequences x 64 tokens = micro 4 x dp 1 x accum 1")
    run = tmp_path / "debug"
    assert f"run folder: {run}" in start[2]
    assert "  checkpoints: every 3 steps, last 3 kept" in start
    assert load_config(run / "config.toml") == load_config("debug", RUN[2:] + [
        "--checkpoint.enabled", "true", "--checkpoint.interval", "3",
        "--job.output_dir", str(tmp_path)])
    assert "\r" not in result.stdout  # no progress bar into a pipe
    done = lines[-1]
    assert re.fullmatch(rf"done: 6 steps in 0:\d\d:\d\d \| final loss \d+\.\d{{4}} \| outputs in "
                        rf"{re.escape(str(run))}: checkpoints/, config\.toml, metrics\.jsonl, "
                        r"tb/", done), done
    last_step = next(line for line in lines if line.startswith("step 6/6 "))
    assert done.split("final loss ")[1].split()[0] in last_step  # step 6's loss


def test_a_terminal_gets_a_progress_bar_between_the_log_lines(tmp_path):
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 wide
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    process = subprocess.Popen(
        [sys.executable, "-m", "dtrain.train", *RUN, "--job.output_dir", str(tmp_path)],
        stdout=secondary, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    os.close(secondary)
    screen = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the run ended and closed the terminal
            break
        if not chunk:
            break
        screen += chunk
    assert process.wait(timeout=60) == 0, process.stderr.read()[-3000:]
    text = screen.decode()
    bars = re.findall(r"train:\s+(\d+)%\|[^|]*\| (\d)/6", text)
    counts = {int(done) for _, done in bars}
    # Drawn between the log lines (tqdm redraws at most every 0.1 s: not every step is seen).
    assert len(counts & {1, 2, 4, 5}) >= 2 and counts <= set(range(7)), counts
    assert re.search(r"^step 3/6 \| loss ", text.replace("\r", "\n"), re.M)
    assert "done: 6 steps in " in text
