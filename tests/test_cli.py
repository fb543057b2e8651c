"""The command line: exit code 2 and one clear line for bad input; --print-config; --help."""

import pytest

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
