"""Megatron-LM indexed datasets: the .bin/.idx format, GPT samples, splits, blends, and
python -m dtrain.preprocess_data."""

import gzip
import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtrain.config import ConfigError
from dtrain.data import indexed
from dtrain.data.blend import BlendedDataset, blending_indices, build_gpt_dataset, parse_blend
from dtrain.data.indexed import (
    GPTSampleDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    split_ranges,
    token_dtype,
)
from dtrain.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "dtrain" / "assets" / "debug" / "tokenizer.json"
# How every error about a damaged .idx/.bin pair ends.
THE_FIX = ("re-create it with python -m dtrain.preprocess_data (or copy it again if it was "
           "transferred)")


def write(prefix: Path, documents: list[list[int]], dtype=np.uint16) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def numbered_documents(lengths: list[int]) -> list[list[int]]:
    """Document d holds tokens 100*d, 100*d + 1, ...: every token says where it came from."""
    return [[100 * d + t for t in range(n)] for d, n in enumerate(lengths)]


# The format, byte for byte ---------------------------------------------------------------------

def test_index_and_data_bytes_match_megatron_layout(tmp_path):
    write(tmp_path / "tiny", [[1, 2, 3], [4, 5], [6]])
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)  # uint16
                    + struct.pack("<Q", 3) + struct.pack("<Q", 4)   # sequences; len(doc indices)
                    + struct.pack("<3i", 3, 2, 1)                   # sequence lengths
                    + struct.pack("<3q", 0, 6, 10)                  # byte offsets into .bin
                    + struct.pack("<4q", 0, 1, 2, 3))               # document indices
    assert (tmp_path / "tiny.idx").read_bytes() == expected_idx
    assert (tmp_path / "tiny.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


def test_empty_document_adds_a_boundary_but_no_sequence(tmp_path):
    # Megatron's preprocess_data does the same for a text that yields no tokens.
    ds = write(tmp_path / "gap", [[7], [], [8, 9]])
    assert len(ds) == 2 and ds.num_documents == 3
    assert ds.document_indices.tolist() == [0, 1, 1, 2]
    assert [ds[i].tolist() for i in range(len(ds))] == [[7], [8, 9]]


def test_round_trip_returns_every_document(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50_000, rng.integers(1, 40)).tolist() for _ in range(200)]
    ds = write(tmp_path / "rt", docs)
    assert len(ds) == 200 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(201))


def test_token_dtype_is_uint16_below_65500_entries_else_int32(tmp_path):
    assert token_dtype(65_499) == np.uint16 and token_dtype(65_500) == np.int32
    ds = write(tmp_path / "big", [[0, 65_535, 128_255]], dtype=token_dtype(128_256))
    assert (tmp_path / "big.idx").read_bytes()[17] == 4  # Megatron's DType code for int32
    assert ds.dtype == np.int32 and ds[0].tolist() == [0, 65_535, 128_255]


def test_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do not fit"), \
            IndexedDatasetWriter(tmp_path / "small", np.uint16) as writer:
        writer.add_document([70_000])
    assert list(tmp_path.iterdir()) == []


def test_get_reads_part_of_a_sequence_from_the_memory_map(tmp_path):
    ds = write(tmp_path / "mm", [[1, 2, 3], [10, 11, 12, 13, 14]])
    part = ds.get(1, offset=1, length=3)
    assert part.tolist() == [11, 12, 13]
    assert isinstance(part.base, np.memmap) and not part.flags.writeable  # a view, not a copy
    assert ds.get(1, offset=3).tolist() == [13, 14]
    with pytest.raises(IndexError):
        ds.get(1, offset=4, length=2)


def test_dataset_pickles_by_reopening_its_files(tmp_path):
    ds = write(tmp_path / "p", [[5, 6]])
    assert pickle.loads(pickle.dumps(ds))[0].tolist() == [5, 6]


def test_interrupted_write_leaves_no_dataset(tmp_path):
    with pytest.raises(KeyboardInterrupt), IndexedDatasetWriter(tmp_path / "half") as writer:
        writer.add_document([1, 2])
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# Damaged files: one message naming the file and the fix ----------------------------------------

def corrupt(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, message", [
    (lambda p: corrupt(p / "d.idx", 0, b"TNTIDX\x00\x00\x00"), "is not a Megatron MMIDIDX index"),
    (lambda p: corrupt(p / "d.idx", 9, struct.pack("<Q", 2)), "has index version 2"),
    (lambda p: corrupt(p / "d.idx", 17, bytes([9])), "unknown dtype code 9"),
    (lambda p: (p / "d.idx").write_bytes((p / "d.idx").read_bytes()[:40]), "d.idx is truncated"),
    (lambda p: (p / "d.bin").write_bytes((p / "d.bin").read_bytes()[:5]), "d.bin is truncated"),
    (lambda p: (p / "d.bin").unlink(), "d.bin not found"),
    (lambda p: (p / "d.idx").unlink(), "d.idx not found"),
], ids=["bad-magic", "version", "dtype-code", "short-idx", "short-bin", "no-bin", "no-idx"])
def test_damaged_dataset_names_the_file_and_the_fix(tmp_path, damage, message):
    write(tmp_path / "d", [[1, 2, 3], [4, 5, 6]])
    damage(tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        IndexedDataset(tmp_path / "d")
    assert "python -m dtrain.preprocess_data" in str(error.value)


# The index of write(tmp_path / "d", [[1, 2, 3], [4, 5, 6]]): S = 2 sequences of uint16 tokens
# (d.bin is 12 bytes), D = 3 document indices; where each array starts in d.idx.
LENGTHS_AT = indexed.HEADER_BYTES  # int32 lengths 3, 3
POINTERS_AT = LENGTHS_AT + 2 * 4  # int64 byte offsets 0, 6
DOCUMENTS_AT = POINTERS_AT + 2 * 8  # int64 document indices 0, 1, 2
INDEX_BYTES = DOCUMENTS_AT + 3 * 8


def damage_entry(path: Path, fmt: str, offset: int, value: int) -> None:
    """Overwrites one little-endian field of the file on disk."""
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


def append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


@pytest.mark.parametrize("damage, message", [
    (lambda p: damage_entry(p / "d.idx", "<i", LENGTHS_AT + 4, -3),
     "d.idx, sequence 1: length -3 (a length must be >= 0)"),
    (lambda p: damage_entry(p / "d.idx", "<q", POINTERS_AT + 8, 4096),
     "d.idx, sequence 1: pointer 4096 (expected 6, where sequence 0 ends: sequences lie back to "
     "back); 4096 lies outside d.bin, which holds 12 bytes"),
    (lambda p: damage_entry(p / "d.idx", "<q", POINTERS_AT + 8, 4),
     "d.idx, sequence 1: pointer 4 (expected 6, where sequence 0 ends: sequences lie back to "
     "back)"),
    (lambda p: damage_entry(p / "d.idx", "<q", POINTERS_AT, 2),
     "d.idx, sequence 0: pointer 2 (expected 0, the start of d.bin)"),
    (lambda p: damage_entry(p / "d.idx", "<i", LENGTHS_AT + 4, 50),
     "d.bin is truncated: it holds 12 bytes, its index d.idx describes 106"),
    (lambda p: append(p / "d.bin", b"\0\0"),
     "d.bin holds 14 bytes, more than the 12 its index d.idx describes: the two files do not "
     "belong together"),
    (lambda p: damage_entry(p / "d.idx", "<q", DOCUMENTS_AT, 1),
     "d.idx, document index 0: 1 (expected 0)"),
    (lambda p: damage_entry(p / "d.idx", "<q", DOCUMENTS_AT + 8, 5),
     "d.idx, document index 1: 5 (expected at most 2, the sequence count)"),
    (lambda p: damage_entry(p / "d.idx", "<q", DOCUMENTS_AT + 16, 0),
     "d.idx, document index 2: 0 (expected at least 1, the index before it: document indices "
     "never decrease)"),
    (lambda p: damage_entry(p / "d.idx", "<q", DOCUMENTS_AT + 16, 1),
     "d.idx, document index 2: 1 (expected 2, the sequence count, as the last index)"),
    (lambda p: (p / "d.idx").write_bytes((p / "d.idx").read_bytes()[:-8]),
     f"d.idx is truncated: 2 sequences and 3 document indices take {INDEX_BYTES} bytes, the "
     f"file has {INDEX_BYTES - 8}"),
    (lambda p: append(p / "d.idx", b"\0\0\0"),
     f"d.idx holds more than its header describes: 2 sequences and 3 document indices take "
     f"{INDEX_BYTES} bytes, the file has {INDEX_BYTES + 3}"),
    (lambda p: append(p / "d.idx", b"\0\0"),  # Megatron's sequence modes, one byte each
     "one byte per sequence more: a multimodal index, which dtrain does not read"),
    (lambda p: (damage_entry(p / "d.idx", "<Q", 26, 0),
                (p / "d.idx").write_bytes((p / "d.idx").read_bytes()[:DOCUMENTS_AT])),
     "d.idx has no document indices (Megatron writes at least the leading 0)"),
], ids=["negative-length", "pointer-past-bin", "overlapping-pointer", "first-pointer",
        "length-past-bin", "long-bin", "first-document", "document-past-count",
        "decreasing-document", "last-document", "cut-idx", "long-idx", "multimodal-idx",
        "no-documents"])
def test_damaged_index_entry_is_named_with_its_value_and_the_fix(tmp_path, damage, message):
    write(tmp_path / "d", [[1, 2, 3], [4, 5, 6]])
    damage(tmp_path)
    with pytest.raises(ConfigError) as error:
        IndexedDataset(tmp_path / "d")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).endswith(f"; {THE_FIX}")


@pytest.mark.parametrize("block", [1, 2, 3, 1 << 20])
def test_index_is_checked_block_by_block_with_the_same_result(tmp_path, monkeypatch, block):
    # Blocks of 1 to 3 entries put a block boundary between every pair the checks compare.
    monkeypatch.setattr(indexed, "CHECK_BLOCK", block)
    prefix = tmp_path / "d"
    write(prefix, numbered_documents([4, 1, 6, 2, 5, 3, 7]))
    assert IndexedDataset(prefix).sequence_lengths.tolist() == [4, 1, 6, 2, 5, 3, 7]
    damage_entry(Path(f"{prefix}.idx"), "<i", LENGTHS_AT + 4 * 6, -1)
    damage_entry(Path(f"{prefix}.idx"), "<q", LENGTHS_AT + 7 * 4 + 8 * 4, 99)
    with pytest.raises(ConfigError, match="sequence 4: pointer 99 "):  # the first of the two
        IndexedDataset(prefix)


def test_cli_refuses_a_damaged_index_in_one_error_line(tmp_path, capsys):
    from dtrain.train import main

    write(tmp_path / "d", numbered_documents([40] * 20))
    damage_entry(tmp_path / "d.idx", "<i", LENGTHS_AT + 4 * 17, -3)
    code = main(["--recipe", "debug", "--data.source", "indexed", "--data.path",
                 str(tmp_path / "d"), "--model.n_layers", "1", "--training.seq_len", "64",
                 "--training.steps", "1", "--metrics.tensorboard", "false",
                 "--job.output_dir", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: data.path: index {tmp_path / 'd.idx'}, sequence 17: length -3 (a length must "
        f"be >= 0); {THE_FIX}"]


def test_an_open_dataset_reads_on_after_its_files_are_deleted(tmp_path):
    # The memory maps hold the files' data, so deleting the pair mid-run costs the run nothing.
    ds = write(tmp_path / "d", [[1, 2, 3], [4, 5, 6]])
    for name in ("d.idx", "d.bin"):
        (tmp_path / name).unlink()
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4, 5, 6]]


# GPT samples -------------------------------------------------------------------------------------

LENGTHS = [5, 1, 17, 3, 9, 2, 30, 4, 6, 11, 7, 8]


@pytest.fixture
def numbered(tmp_path) -> IndexedDataset:
    return write(tmp_path / "num", numbered_documents(LENGTHS))


def in_sample_order(samples: GPTSampleDataset) -> list[list[int]]:
    """Windows in the order they were cut (undoing the shuffle)."""
    return [samples.window(int(i)).tolist() for i in np.argsort(samples.shuffle_index)]


def test_one_epoch_of_samples_holds_every_token_in_order(numbered, tmp_path):
    seq_len = 8
    samples = GPTSampleDataset(numbered, range(2, 12), seq_len, None, seed=3, cache_dir=tmp_path)
    assert sorted(samples.document_index.tolist()) == list(range(2, 12))  # one shuffled epoch
    stream = [t for d in samples.document_index for t in numbered[int(d)].tolist()]
    windows = in_sample_order(samples)
    assert len(windows) == (len(stream) - 1) // seq_len
    for first, second in zip(windows, windows[1:], strict=False):
        assert first[-1] == second[0]  # consecutive samples share one token
    joined = [t for w in windows for t in w[:-1]] + [windows[-1][-1]]
    # Every token in order; only a tail shorter than one sample is left out.
    assert joined == stream[:len(joined)] and len(stream) - len(joined) < seq_len


def test_samples_span_document_boundaries(numbered, tmp_path):
    samples = GPTSampleDataset(numbered, range(12), 8, None, seed=0, cache_dir=tmp_path)
    sources = [{t // 100 for t in samples.window(i).tolist()} for i in range(len(samples))]
    assert all(len(w) == 9 for w in map(samples.window, range(len(samples))))
    assert any(len(s) >= 3 for s in sources)  # e.g. a sample through documents 0, 1 and 2


def test_more_samples_than_one_epoch_repeat_every_document(numbered, tmp_path):
    tokens = sum(LENGTHS)
    samples = GPTSampleDataset(numbered, range(12), 8, 3 * tokens // 8, seed=0,
                               cache_dir=tmp_path)
    counts = np.bincount(samples.document_index, minlength=12)
    assert len(samples) >= 3 * tokens // 8 and (counts == counts[0]).all() and counts[0] >= 3


def test_sample_order_depends_only_on_the_seed(numbered, tmp_path):
    def order(seed: int) -> list[list[int]]:
        ds = GPTSampleDataset(numbered, range(12), 8, None, seed=seed, cache_dir=tmp_path / "c")
        return [ds.window(i).tolist() for i in range(len(ds))]

    assert order(1) == order(1) and order(1) != order(2)


def test_sample_indices_are_cached_and_reused(numbered, tmp_path, monkeypatch):
    first = GPTSampleDataset(numbered, range(12), 8, 20, seed=5, cache_dir=tmp_path / "cache")
    files = sorted((tmp_path / "cache").glob("*.npy"))
    assert not first.loaded_from_cache and len(files) == 3
    mtimes = [f.stat().st_mtime_ns for f in files]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the sample index was rebuilt instead of loaded")

    monkeypatch.setattr(indexed, "build_sample_index", no_rebuild)
    second = GPTSampleDataset(numbered, range(12), 8, 20, seed=5, cache_dir=tmp_path / "cache")
    assert second.loaded_from_cache and [f.stat().st_mtime_ns for f in files] == mtimes
    assert [second.window(i).tolist() for i in range(20)] == [
        first.window(i).tolist() for i in range(20)]


def test_cache_defaults_to_a_folder_beside_the_data(numbered):
    samples = GPTSampleDataset(numbered, range(12), 8)
    assert samples.cache_prefix.parent == Path(numbered.prefix).parent / "index_cache"


def test_a_split_smaller_than_one_sample_is_a_config_error(numbered, tmp_path):
    with pytest.raises(ConfigError, match="fewer than one sample"):
        GPTSampleDataset(numbered, range(1, 2), 8, None, cache_dir=tmp_path)


def test_gpt_samples_feed_the_data_loader(numbered, tmp_path):
    from dtrain.data.loader import DataLoader

    samples = GPTSampleDataset(numbered, range(12), 8, None, cache_dir=tmp_path)
    inputs, labels = DataLoader(samples, micro_batch=2, shuffle=False).next_batch()
    assert inputs.shape == labels.shape == (2, 8)
    assert inputs[0, 1:].tolist() == labels[0, :-1].tolist()


# Splits ------------------------------------------------------------------------------------------

def test_split_969_30_1_matches_megatron_rounding():
    # cumulative 0.969, 0.999, 1.0 times n, rounded
    assert split_ranges("969,30,1", 1000) == [range(0, 969), range(969, 999), range(999, 1000)]
    assert split_ranges("969,30,1", 10) == [range(0, 10), range(10, 10), range(10, 10)]
    assert split_ranges("969,30,1", 2000) == [range(0, 1938), range(1938, 1998),
                                              range(1998, 2000)]


def test_split_98_2_0_leaves_test_empty():
    assert split_ranges("98,2,0", 100) == [range(0, 98), range(98, 100), range(100, 100)]
    # 0.98 * 1234 = 1209.32
    assert split_ranges("98,2,0", 1234) == [range(0, 1209), range(1209, 1234), range(1234, 1234)]


def test_split_with_fewer_weights_pads_with_zero_and_bad_split_is_refused():
    assert split_ranges("1", 7) == [range(0, 7), range(7, 7), range(7, 7)]
    for bad in ["", "a,b", "1,2,3,4", "0,0,0", "-1,2"]:
        with pytest.raises(ConfigError, match="e.g. '969,30,1'"):
            split_ranges(bad, 10)


# Blends ------------------------------------------------------------------------------------------

def test_blend_of_03_and_07_over_1000_samples_takes_exactly_300_and_700():
    which, nth = blending_indices([0.3, 0.7], 1000)
    assert np.bincount(which).tolist() == [300, 700]
    counts = np.cumsum(np.eye(2, dtype=int)[which], axis=0)  # counts after each prefix
    n = np.arange(1, 1001)[:, None]
    assert (np.abs(counts - np.array([0.3, 0.7]) * n) <= 1).all()
    # Each dataset's samples are taken in order 0, 1, 2, ...
    assert nth[which == 0].tolist() == list(range(300))


def test_blend_order_is_megatrons_greedy_choice():
    # argmax_i(w_i * max(n, 1) - count_i), by hand for n = 0..9
    assert blending_indices([0.3, 0.7], 10)[0].tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]


def test_blend_of_three_stays_within_one_sample_of_its_share():
    weights = np.array([0.5, 0.3, 0.2])
    which, _ = blending_indices(weights.tolist(), 5000)
    counts = np.cumsum(np.eye(3, dtype=int)[which], axis=0)
    assert (np.abs(counts - weights * np.arange(1, 5001)[:, None]) <= 1).all()


class Constant:
    """A window source whose window i is [tag, i]."""

    def __init__(self, tag: int, size: int):
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def window(self, index: int) -> np.ndarray:
        return np.array([self.tag, index])


def test_blended_window_comes_from_the_chosen_dataset():
    blend = BlendedDataset([Constant(0, 40), Constant(1, 80)], [1, 3], 100)
    windows = [blend.window(i).tolist() for i in range(len(blend))]
    assert [w for w in windows if w[0] == 0] == [[0, i] for i in range(25)]
    assert [w for w in windows if w[0] == 1] == [[1, i] for i in range(75)]


def test_blend_refuses_a_dataset_too_small_for_its_share():
    with pytest.raises(ConfigError, match="dataset 0 holds 10 samples, the blend takes 25"):
        BlendedDataset([Constant(0, 10), Constant(1, 80)], [1, 3], 100)


def test_blend_string_and_pairs_parse_to_normalised_weights():
    expected = [(0.3, "data/a"), (0.7, "data/b")]
    assert parse_blend("0.3 data/a 0.7 data/b") == pytest.approx(expected)
    assert parse_blend("30 data/a 70 data/b") == pytest.approx(expected)
    assert parse_blend([(3, "data/a"), (7, "data/b")]) == pytest.approx(expected)
    assert parse_blend("data/a") == [(1.0, "data/a")]
    with pytest.raises(ConfigError, match="weight prefix weight prefix"):
        parse_blend("0.3 data/a data/b")


def test_build_gpt_dataset_blends_the_train_split_of_each_prefix(tmp_path):
    for name in "ab":
        write(tmp_path / name, numbered_documents([20] * 50))
    blend = build_gpt_dataset(f"0.25 {tmp_path / 'a'} 0.75 {tmp_path / 'b'}", seq_len=16,
                              num_samples=30, split="90,10,0", cache_dir=tmp_path / "c")
    assert len(blend) == 8 + 23  # ceil(30 * 0.25) + ceil(30 * 0.75), Megatron's sizes
    assert np.bincount(blend.dataset_index).tolist() == [8, 23]
    train_docs = set(range(45))  # 90% of 50 documents
    assert all(int(t) // 100 in train_docs for i in range(len(blend)) for t in blend.window(i))


# python -m dtrain.preprocess_data ------------------------------------------------------------

def preprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtrain.preprocess_data",
                           "--tokenizer", str(TOKENIZER), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


TEXTS = ["Return the number of items in a container.", "", "def f(x):\n    return x * 2",
         "naïve café — ünïcode", *[f"line {i} of the corpus " * (i % 5 + 1) for i in range(40)]]


def test_preprocess_matches_direct_tokenization(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS))
                      + "\n\n")  # a trailing blank line is skipped
    result = preprocess("--input", str(source), "--output-prefix", str(tmp_path / "out"),
                        "--workers", "2", "--append-eod", "--log-interval", "10")
    assert result.returncode == 0, result.stderr
    assert "docs/s" in result.stderr and "MB/s" in result.stderr
    tokenizer = Tokenizer(TOKENIZER)
    expected = [tokenizer.encode(t, eos=True) for t in TEXTS if t]
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == len(TEXTS)
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_preprocess_reads_gzip_and_writes_one_dataset_per_key(tmp_path):
    source = tmp_path / "pairs.jsonl.gz"
    with gzip.open(source, "wt") as f:
        f.writelines(json.dumps({"q": f"question {i}", "a": f"answer {i}"}) + "\n"
                     for i in range(5))
    result = preprocess("--input", str(source), "--output-prefix", str(tmp_path / "qa"),
                        "--json-keys", "q", "a")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer(TOKENIZER)
    for key, word in [("q", "question"), ("a", "answer")]:
        ds = IndexedDataset(tmp_path / f"qa_{key}_document")
        assert [ds[i].tolist() for i in range(5)] == [tokenizer.encode(f"{word} {i}")
                                                      for i in range(5)]


def test_preprocess_bad_json_line_exits_2_naming_the_line(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    result = preprocess("--input", str(source), "--output-prefix", str(tmp_path / "out"),
                        "--workers", "2")
    assert result.returncode == 2
    assert f"{source}:3 is not valid JSON" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written


def test_preprocess_missing_key_exits_2_naming_the_line(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    result = preprocess("--input", str(source), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 2
    assert f"{source}:2: key 'text' missing (the line has: body)" in result.stderr
