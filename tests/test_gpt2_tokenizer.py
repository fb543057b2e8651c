"""Megatron-LM's tokenizer files: a GPT-2 vocab.json and merges.txt pair (--vocab-file,
--merge-file) encodes as GPT-2's own tokenizer does, for training and for preprocess_data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import ByteLevelBPETokenizer

from dtrain import Trainer, load_config
from dtrain.config import ConfigError
from dtrain.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Hello world, this is dtrain.", "  leading spaces\tand tabs\nnew lines",
         "naïve café — unicode ✓", "<|endoftext|> a special token inside text"]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A small GPT-2-style byte-level BPE, saved both ways: vocab.json + merges.txt, and the
    tokenizer.json GPT-2's fast tokenizer reads."""
    folder = tmp_path_factory.mktemp("gpt2")
    corpus = [line["text"] for line in map(json.loads, (ROOT / "dtrain/assets/debug/corpus.jsonl")
                                           .read_text().splitlines()[:200])]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=600, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(folder))
    return folder


def test_the_pair_encodes_as_gpt2_s_fast_tokenizer(gpt2_files):
    from transformers import GPT2TokenizerFast

    ours = Tokenizer(gpt2_files / "vocab.json", merges=gpt2_files / "merges.txt")
    theirs = GPT2TokenizerFast(vocab=str(gpt2_files / "vocab.json"),
                               merges=str(gpt2_files / "merges.txt"))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
    for text in TEXTS[:3]:  # decoding drops special tokens, as HF's does by default
        assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id == theirs.convert_tokens_to_ids("<|endoftext|>")
    folder = Tokenizer(gpt2_files)  # a folder holding the pair, without tokenizer.json
    assert [folder.encode(t) for t in TEXTS] == [ours.encode(t) for t in TEXTS]


def test_training_reads_the_pair_from_the_data_section(gpt2_files, tmp_path):
    trainer = Trainer(load_config("debug", {
        "data.tokenizer": str(gpt2_files / "vocab.json"),
        "data.merge_file": str(gpt2_files / "merges.txt"), "model.n_layers": 1,
        "training.steps": 2, "training.seq_len": 32, "training.global_batch_size": 2,
        "training.micro_batch_size": 1, "metrics.log_every": 1, "metrics.tensorboard": False,
        "job.output_dir": str(tmp_path)}))
    assert trainer.tokenizer.vocab_size == 600
    assert [r["step"] for r in trainer.train()] == [1, 2]


def test_a_missing_or_wrong_merges_file_is_one_line(gpt2_files, tmp_path):
    with pytest.raises(ConfigError, match=r"data.merge_file = '.*nope.txt' not found"):
        Tokenizer(gpt2_files / "vocab.json", merges=tmp_path / "nope.txt")
    bad = tmp_path / "merges.txt"
    bad.write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(ConfigError, match="is not a GPT-2 vocab.json and merges.txt pair"):
        Tokenizer(gpt2_files / "vocab.json", merges=bad)


def test_preprocess_data_takes_megatron_s_flags(gpt2_files, tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    result = subprocess.run(
        [sys.executable, "-m", "dtrain.preprocess_data", "--input", str(source),
         "--output-prefix", str(tmp_path / "out"), "--vocab-file",
         str(gpt2_files / "vocab.json"), "--merge-file", str(gpt2_files / "merges.txt"),
         "--append-eod"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    from dtrain.data.indexed import IndexedDataset

    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    ours = Tokenizer(gpt2_files / "vocab.json", merges=gpt2_files / "merges.txt")
    assert [list(dataset[i]) for i in range(len(TEXTS))] == [
        ours.encode(t) + [ours.eos_id] for t in TEXTS]
