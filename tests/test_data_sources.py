"""Training end to end from each data source: Megatron indexed data made by
python -m dtrain.preprocess_data, and HF datasets streamed from JSON lines."""

import subprocess
import sys

import pytest

from dtrain import Trainer, load_config
from dtrain.assets import ROOT as ASSETS
from dtrain.config import ConfigError

TINY = {"model.n_layers": 1, "training.seq_len": 64, "training.global_batch_size": 4,
        "training.steps": 12, "lr_schedule.warmup_steps": 2, "metrics.log_every": 1,
        "metrics.tensorboard": False}


@pytest.fixture(scope="module")
def indexed_prefix(tmp_path_factory):
    out = tmp_path_factory.mktemp("indexed")
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.preprocess_data", "--input", str(ASSETS / "debug" /
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


def test_validation_on_the_indexed_valid_split(tmp_path, indexed_prefix):
    cfg = load_config("debug", {**TINY, "training.steps": 4, "data.source": "indexed",
                                "data.path": str(indexed_prefix),
                                "data.index_cache": str(tmp_path / "c"),
                                "validation.enabled": True, "validation.interval": 2,
                                "validation.steps": 2, "job.output_dir": str(tmp_path)})
    trainer = Trainer(cfg)
    trainer.train()
    assert [r["step"] for r in trainer.val_history] == [2, 4]
    assert trainer.val_history[1]["val_loss"] < trainer.val_history[0]["val_loss"]
    # The same held-out batches every time: evaluating twice gives the same loss.
    assert trainer.evaluate() == trainer.evaluate()
    logged = (tmp_path / "debug" / "metrics.jsonl").read_text()
    assert '"val_perplexity"' in logged


def test_validation_of_a_text_source_needs_a_path(tmp_path):
    cfg = load_config("debug", {**TINY, "validation.enabled": True,
                                "job.output_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="needs validation.path"):
        Trainer(cfg)
