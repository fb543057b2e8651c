"""The HF datasets source: local formats, sharding over ranks, packing and resuming."""

import json

import numpy as np
import pytest

from dtrain.config import ConfigError, DataConfig
from dtrain.data.hf import HFWindowStream
from dtrain.data.tokenizer import Tokenizer, padded_vocab_size

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer("builtin:debug/tokenizer.json")


@pytest.fixture
def docs():
    return [f"document number {i} says " + "word " * (i % 7 + 3) for i in range(40)]


def write_jsonl(path, docs, field="text"):
    path.write_text("\n".join(json.dumps({field: d, "id": i}) for i, d in enumerate(docs)))
    return path


def stream_tokens(tokenizer, docs):
    return [t for ids in tokenizer.encode_batch(docs, bos=True, eos=True) for t in ids]


def take(stream, n):
    return [stream.next_window() for _ in range(n)]


def test_jsonl_is_packed_in_document_order(tmp_path, tokenizer, docs):
    cfg = DataConfig(source="hf", path=str(write_jsonl(tmp_path / "d.jsonl", docs)))
    windows = take(HFWindowStream(cfg, tokenizer, SEQ), 5)
    expected = stream_tokens(tokenizer, docs)
    for i, w in enumerate(windows):
        assert w.tolist() == expected[i * SEQ: i * SEQ + SEQ + 1]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "tsv", "txt"])
def test_parquet_csv_tsv_and_text_files(tmp_path, tokenizer, docs, fmt):
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": docs}), path)
    elif fmt in ("csv", "tsv"):  # read by column: the header and the ids are not text
        sep = "," if fmt == "csv" else "\t"
        path = tmp_path / f"d.{fmt}"
        path.write_text(f"id{sep}text\n" + "".join(f'{i}{sep}"{d}"\n' for i, d in enumerate(docs)))
    else:  # the text builder yields one document per line
        path = tmp_path / "d.txt"
        path.write_text("\n".join(docs) + "\n")
    cfg = DataConfig(source="hf", path=str(path))
    window = HFWindowStream(cfg, tokenizer, SEQ).next_window()
    assert window.tolist() == stream_tokens(tokenizer, docs)[: SEQ + 1]


def test_two_ranks_read_disjoint_documents_covering_all(tmp_path, tokenizer, docs):
    cfg = DataConfig(source="hf", path=str(write_jsonl(tmp_path / "d.jsonl", docs)))
    seen = []
    for rank in range(2):
        stream = HFWindowStream(cfg, tokenizer, SEQ, dp_rank=rank, dp_size=2)
        while stream.epoch == 0:
            stream.next_window()
        seen.append(stream.documents_read - stream.documents)  # the first epoch's
    assert seen[0] + seen[1] == len(docs)


def test_resume_continues_the_same_windows(tmp_path, tokenizer, docs):
    cfg = DataConfig(source="hf", path=str(write_jsonl(tmp_path / "d.jsonl", docs)))
    stream = HFWindowStream(cfg, tokenizer, SEQ)
    take(stream, 7)
    state = json.loads(json.dumps(stream.state_dict()))  # survives serialisation
    rest = take(stream, 30)  # runs into the second epoch
    resumed = HFWindowStream(cfg, tokenizer, SEQ)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(take(resumed, 30), rest, strict=True))


def test_resume_under_another_degree_is_refused(tmp_path, tokenizer, docs):
    cfg = DataConfig(source="hf", path=str(write_jsonl(tmp_path / "d.jsonl", docs)))
    state = HFWindowStream(cfg, tokenizer, SEQ, dp_rank=0, dp_size=2).state_dict()
    with pytest.raises(ConfigError, match="saved with 2 data-parallel ranks and this run has 1"):
        HFWindowStream(cfg, tokenizer, SEQ).load_state_dict(state)


def test_missing_text_field_names_the_fields(tmp_path, tokenizer, docs):
    cfg = DataConfig(source="hf", path=str(write_jsonl(tmp_path / "d.jsonl", docs, "body")))
    with pytest.raises(ConfigError, match="no field 'text': set data.text_field to one of body"):
        HFWindowStream(cfg, tokenizer, SEQ).next_window()


def test_unknown_dataset_name_is_a_config_error(tokenizer, monkeypatch):
    import datasets
    import huggingface_hub

    # Offline, so the answer does not depend on (or wait for) the network.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="neither a local file nor a dataset"):
        HFWindowStream(DataConfig(source="hf", path="no-such-org/no-such-data"), tokenizer, SEQ)


def test_vocab_padding_and_special_token_override(tokenizer):
    assert padded_vocab_size(4096, 128) == 4096
    assert padded_vocab_size(50257, 128) == 50304
    assert padded_vocab_size(128256, 128 * 8) == 129024
    with pytest.raises(ConfigError, match="bos token '<s>' is not in the tokenizer's vocab"):
        Tokenizer("builtin:debug/tokenizer.json", bos="<s>")
    swapped = Tokenizer("builtin:debug/tokenizer.json", bos="<|end_of_text|>")
    assert swapped.bos_id == tokenizer.eos_id


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".parquet", ".arrow"])
def test_tables_given_to_the_text_source_are_refused_naming_the_hf_source(tmp_path, suffix):
    from dtrain.data.documents import read_documents

    table = tmp_path / f"corpus{suffix}"
    table.write_text("id,text\n1,a\n")
    with pytest.raises(ConfigError, match=rf"is a \{suffix} table, which the text source would "
                                          r"read as plain text .*: set data.source = 'hf'"):
        next(read_documents(table, "text"))
