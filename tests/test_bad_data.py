"""Bad data files and tokenizers end the CLI with one ``error:`` line that names the problem."""

import json

import pytest
from conftest import cli_args, start_cli, wait_for_step


@pytest.fixture
def train(cli, tmp_path):
    """Runs one tiny training step of the debug recipe on ``path``, plus ``extra`` arguments."""
    def run(path, *extra):
        return cli(["--recipe", "debug", "--data.path", str(path), "--training.steps", "1",
                    "--model.n_layers", "1", "--training.seq_len", "64",
                    "--training.global_batch_size", "1", "--training.micro_batch_size", "1",
                    "--metrics.tensorboard", "false", "--job.output_dir", str(tmp_path / "out"),
                    *extra])
    return run


def error_line(result) -> str:
    """The single error line of a run refused for bad input (exit code 2, no traceback)."""
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


def test_text_json_line_that_is_not_an_object_names_file_and_line(train, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a first document"}\n42\n')
    line = error_line(train(path))
    assert "docs.jsonl:2 is a JSON number, not an object" in line
    assert "each line a JSON object with the text in field 'text'" in line


def test_text_null_text_names_file_line_field_and_type(train, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a first document"}\n{"text": null}\n')
    line = error_line(train(path))
    assert "docs.jsonl:2 has field 'text' of type null, not a string" in line


def test_text_invalid_utf8_names_file_and_line(train, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "a first document"}\n{"text": "caf\xe9"}\n')
    line = error_line(train(path))
    assert "docs.jsonl:2 is not UTF-8 text" in line and "must be UTF-8" in line


def test_hf_malformed_json_line_names_file_and_line(train, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a first document"}\n{oops\n{"text": "a third"}\n')
    line = error_line(train(path, "--data.source", "hf"))
    assert "docs.jsonl:2 is not valid JSON" in line and "fix or remove that line" in line


def test_hf_null_text_names_file_line_field_and_type(train, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a first document"}\n{"text": null}\n')
    line = error_line(train(path, "--data.source", "hf"))
    assert "docs.jsonl:2 has field 'text' of type null, not a string" in line


def test_tokenizer_that_is_not_a_tokenizer_json_names_the_path(train, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a first document"}\n')
    notes = tmp_path / "notes.txt"
    notes.write_text("not a tokenizer\n")
    line = error_line(train(data, "--data.tokenizer", str(notes)))
    assert f"data.tokenizer = '{notes}' is not a HF tokenizer.json" in line
    assert "a folder holding one" in line


def test_hf_data_file_deleted_mid_run_names_the_file_and_the_fix(tmp_path):
    # datasets reads a small file whole at the start of each epoch and reopens it for the next:
    # 8 documents of ~50 tokens are an epoch of under two steps, so the deletion is met soon.
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {d}: " + "some words " * 20}) + "\n"
                            for d in range(8)))
    process = start_cli(cli_args({
        "model.n_layers": 1, "training.seq_len": 64, "training.global_batch_size": 4,
        "training.micro_batch_size": 1, "training.steps": 100_000, "metrics.log_every": 1,
        "metrics.tensorboard": False, "data.source": "hf", "data.path": path,
        "job.output_dir": tmp_path / "out"}))
    try:
        wait_for_step(process, 2, [])
        path.unlink()
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == [
        f"error: data file {path} could not be read during the run (No such file or "
        "directory): it was moved or deleted; restore it and run the same command again (it "
        "resumes from the latest checkpoint when checkpointing is on)"]


def test_a_csv_given_to_the_text_source_is_refused_naming_the_hf_source(train, tmp_path):
    table = tmp_path / "corpus.csv"
    table.write_text("id,text\n" + "".join(f'{i},"document {i}"\n' for i in range(50)))
    assert error_line(train(table)) == (
        f"error: data.path = {str(table)!r} is a .csv table, which the text source would read "
        "as plain text (headers, separators and quotes included): set data.source = 'hf', "
        "which reads its columns, and data.text_field to the column that holds the text")
    result = train(table, "--data.source", "hf")  # the fix the line names trains
    assert result.returncode == 0, result.stderr[-2000:]
