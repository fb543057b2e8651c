"""The dry run checks what a launch would: the inputs a launch opens (tokenizer, data files and
indexes, held-out data, initial weights), each missing one the launch's own one-line error, and
the predicted peak against a memory budget, naming the planner's layout when it is over; the
DeepSeek-V3 recipes at their world sizes."""

import re
from types import SimpleNamespace

import pytest
import torch

from dtrain.config import load_config
from dtrain.data.indexed import IndexedDatasetWriter
from dtrain.plan.constants import H200
from dtrain.plan.dry_run import Budget, dry_run
from dtrain.plan.memory import GIB
from dtrain.train import main

# llama3_8b at its full world size; 2 of its 32 blocks where only the inputs matter (fast).
FULL = ["--recipe", "llama3_8b", "--dry-run", "--dry-run-world-size", "8"]
SMALL = [*FULL, "--model.n_layers", "2", "--gpu-memory-gb", "80"]


def error_line(capsys) -> str:
    """The run's one stderr line (nothing on stdout: no report for a run that cannot start)."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), (out, err)
    return lines[0]


def write_indexed(prefix) -> None:
    with IndexedDatasetWriter(prefix) as writer:
        writer.add_document([1, 2, 3])


# ---- inputs ------------------------------------------------------------------------------

def test_a_missing_data_file_is_the_launchs_line(tmp_path, capsys):
    missing = tmp_path / "corpus.jsonl"
    assert main([*SMALL, "--data.path", str(missing)]) == 2
    assert error_line(capsys) == (f"error: data.path: file {missing} not found: set data.path "
                                  "to a .jsonl, .json or text file")


def test_a_missing_tokenizer_is_the_launchs_line(tmp_path, capsys):
    missing = tmp_path / "tokenizer.json"
    assert main([*SMALL, "--data.tokenizer", str(missing)]) == 2
    assert error_line(capsys) == (f"error: tokenizer file {missing} not found: set "
                                  "data.tokenizer to a tokenizer.json or a folder holding one")


@pytest.mark.parametrize("make,problem", [
    (lambda path: None, "{path} does not exist"),
    (lambda path: path.mkdir(), "{path} has no .metadata"),
], ids=["absent", "not-a-checkpoint"])
def test_missing_initial_weights_are_the_launchs_line(tmp_path, capsys, make, problem):
    path = tmp_path / "weights"
    make(path)
    assert main([*SMALL, "--checkpoint.initial_weights", str(path)]) == 2
    line = error_line(capsys)
    assert line.startswith(f"error: checkpoint.initial_weights = '{path}' cannot be loaded: "
                           f"{problem.format(path=path)}")
    assert line.endswith("Give a checkpoint of this model's shape (made by "
                         "python -m dtrain.convert_hf import or by a dtrain run)")


def test_initial_weights_are_not_read_by_a_run_that_resumes(tmp_path, capsys):
    (tmp_path / "llama3_8b" / "checkpoints" / "step-0000010").mkdir(parents=True)
    assert main([*SMALL, "--job.output_dir", str(tmp_path), "--checkpoint.enabled", "true",
                 "--checkpoint.initial_weights", str(tmp_path / "absent")]) == 0
    assert "checkpoint.initial_weights not read: the run resumes" in capsys.readouterr().out


def test_each_dataset_of_an_indexed_blend_is_opened(tmp_path, capsys):
    write_indexed(tmp_path / "a")
    blend = f"0.3 {tmp_path / 'a'} 0.7 {tmp_path / 'b'}"
    assert main([*SMALL, "--data.source", "indexed", "--data.path", blend]) == 2
    assert error_line(capsys) == (
        f"error: data.path: indexed dataset file {tmp_path / 'b'}.idx not found: give the "
        "prefix without .bin/.idx, or create the dataset with python -m dtrain.preprocess_data")
    write_indexed(tmp_path / "b")
    assert main([*SMALL, "--data.source", "indexed", "--data.path", blend]) == 0
    assert f"data.path = '{blend}' (indexed)" in capsys.readouterr().out


def test_a_damaged_index_is_found_without_reading_the_data(tmp_path, capsys):
    write_indexed(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes((tmp_path / "a.idx").read_bytes()[:-1])
    assert main([*SMALL, "--data.source", "indexed", "--data.path", str(tmp_path / "a")]) == 2
    assert f"{tmp_path / 'a'}.idx is truncated" in error_line(capsys)


def test_a_hub_dataset_name_is_reported_as_not_checked_offline(capsys):
    assert main([*SMALL, "--data.source", "hf", "--data.path", "HuggingFaceFW/fineweb"]) == 0
    assert ("data.path = 'HuggingFaceFW/fineweb': a dataset name on the HF hub, not checked "
            "offline (the launch loads it)") in capsys.readouterr().out


def test_a_missing_local_hf_path_is_an_error_not_a_hub_name(tmp_path, capsys):
    missing = tmp_path / "shards"
    assert main([*SMALL, "--data.source", "hf", "--data.path", str(missing)]) == 2
    assert error_line(capsys).startswith(f"error: data.path = '{missing}': no such file or "
                                         "folder: set data.path to a local file or folder")


def test_missing_held_out_data_names_validation_path(tmp_path, capsys):
    missing = tmp_path / "held_out.jsonl"
    assert main([*SMALL, "--validation.enabled", "true", "--validation.path", str(missing)]) == 2
    assert error_line(capsys) == (f"error: validation.path: file {missing} not found: set "
                                  "validation.path to a .jsonl, .json or text file")


def test_the_report_lists_the_inputs_it_found(capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "inputs (found)     data.tokenizer = 'builtin:debug/tokenizer.json'" in out
    assert "data.path = 'builtin:debug/corpus.jsonl' (text)" in out


# ---- memory budget -----------------------------------------------------------------------

def usable_gib(gpu_memory_gb: float) -> float:
    """The planner's usable share of one GPU (``planner.evaluate``), in GiB."""
    return gpu_memory_gb * 1e9 * H200.usable_memory / GIB


def test_a_peak_over_the_budget_names_a_planner_layout_that_fits(capsys):
    # llama3_8b's FSDP 8 predicts about 30 GiB on rank 0: over the usable part of 30 GB.
    assert main([*FULL, "--gpu-memory-gb", "30"]) == 2
    line = error_line(capsys)
    assert re.match(rf"error: rank 0's predicted peak [\d.]+ GiB is over the 30 GB GPU's "
                    rf"usable {usable_gib(30):.1f} GiB \(85%; --gpu-memory-gb\): the planner's "
                    r"fastest fitting layout for 8 GPUs \(8 per node\) is tp \d+, pp \d+", line)
    flags = re.search(r"\((--[^)]*)\), predicted peak", line).group(1).split()
    # The layout it names, applied as the flags it gives, fits the same budget.
    assert main([*FULL, "--gpu-memory-gb", "30", *flags]) == 0
    assert "headroom" in capsys.readouterr().out


def test_when_no_layout_fits_more_gpus_are_needed(capsys):
    assert main([*FULL, "--gpu-memory-gb", "5"]) == 2
    line = error_line(capsys)
    assert "no layout the planner knows fits 8 GPUs (8 per node): use more GPUs" in line
    assert "python -m dtrain.plan --model llama3_8b --gpus 8" in line


def test_a_peak_within_the_budget_reports_budget_and_headroom(capsys):
    assert main([*FULL, "--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    peak = float(re.search(r"peak \(est\.\) +([\d.]+) GiB", out).group(1))
    usable = float(re.search(r"usable memory +([\d.]+) GiB \(85% of the 80 GB GPU, "
                             r"--gpu-memory-gb\)", out).group(1))
    headroom = float(re.search(r"headroom +([\d.]+) GiB", out).group(1))
    assert usable == pytest.approx(usable_gib(80), abs=0.01)
    assert headroom == pytest.approx(usable - peak, abs=0.02)


def test_without_a_gpu_or_a_figure_there_is_no_budget(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*FULL, "--model.n_layers", "2"]) == 0
    assert "memory budget: none (no GPU here: give --gpu-memory-gb)" in capsys.readouterr().out


def test_the_default_budget_is_this_machines_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(
        total_memory=85_000_000_000, name="NVIDIA H100 80GB HBM3"))
    assert Budget.of(None) == Budget(85.0, "this machine's NVIDIA H100 80GB HBM3")
    assert Budget.of(141.0) == Budget(141.0, "--gpu-memory-gb")


def test_budget_options_without_the_dry_run_are_refused(capsys):
    assert main(["--recipe", "debug", "--gpu-memory-gb", "80"]) == 2
    assert error_line(capsys) == ("error: --gpu-memory-gb and --gpus-per-node are for the dry "
                                  "run: add --dry-run, or leave them out (training uses the "
                                  "GPUs it runs on)")


# ---- the DeepSeek-V3 recipes at their world sizes ----------------------------------------

# (recipe, world size, rank, holds the last stage): each first pipeline rank; Megatron's layout's
# last rank (7 x 128) and DualPipeV's rank 0 hold the MTP depth and the output layer.
DEEPSEEK = [("deepseek_v3_671b", 1024, 0, False), ("deepseek_v3_671b", 1024, 896, True),
            ("deepseek_v3_671b_2048", 2048, 0, True), ("deepseek_v3_16b_8gpu", 8, 0, True),
            ("deepseek_v3_16b", 1, 0, True)]


@pytest.mark.parametrize("recipe,world,rank,last", DEEPSEEK)
def test_a_deepseek_recipe_dry_runs_at_its_world_size_within_80gb(recipe, world, rank, last):
    report = dry_run(load_config(recipe), world, rank, budget=Budget(80.0, "--gpu-memory-gb"))
    assert (report.num_stages - 1 in report.stages) == last
    # The memory model counts the rank's shards as the built stages hold them: MLA split and
    # whole under TP, dense-first layers, the experts over EP, the MTP depth with the output.
    assert report.local_params == pytest.approx(report.estimate.local_params, rel=1e-3)
    assert not report.over_budget and report.peak_bytes < 80e9 * H200.usable_memory
