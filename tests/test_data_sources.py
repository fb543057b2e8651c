"""Training end to end from each data source: Megatron indexed data made by
tools/preprocess_data.py, and HF datasets streamed from JSON lines."""

import subprocess
import sys

import pytest

from dtrain import Trainer, load_config
from dtrain.assets import ROOT as ASSETS

TINY = {"model.n_layers": 1, "training.seq_len": 64, "training.global_batch_size": 4,
        "training.steps": 12, "lr_schedule.warmup_steps": 2, "metrics.log_every": 1,
        "metrics.tensorboard": False}


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory):
    out = tmp_path_factory.mktemp("indexed")
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(ASSETS / "debug" /
         "corpus.jsonl"), "--output-prefix", str(out / "corpus"), "--tokenizer",
         str(ASSETS / "debug"), "--append-eod", "--workers", "2"],
        capture_output=True, text=True, cwd=ASSETS.parent.parent, timeout=300)
    assert result.returncode == 0, result.stderr
    return out / "corpus_text_document"


@pytest.mark.parametrize("source", ["indexed", "hf"])
def test_training_from_source_reduces_loss(tmp_path, indexed_prefix, source):
    path = str(indexed_prefix) if source == "indexed" else str(ASSETS / "debug" / "corpus.jsonl")
    cfg = load_config("debug", {**TINY, "data.source": source, "data.path": path,
                                "data.index_cache": str(tmp_path / "cache"),
                                "job.output_dir": str(tmp_path)})
    history = Trainer(cfg).train()
    assert history[-1]["loss"] < history[0]["loss"] - 0.5


def test_blend_of_two_prefixes_trains(tmp_path, indexed_prefix):
    blend = f"0.3 {indexed_prefix} 0.7 {indexed_prefix}"
    cfg = load_config("debug", {**TINY, "training.steps": 2, "data.source": "indexed",
                                "data.path": blend, "data.index_cache": str(tmp_path / "c"),
                                "job.output_dir": str(tmp_path)})
    assert len(Trainer(cfg).train()) == 2
