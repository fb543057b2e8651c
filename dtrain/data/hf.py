"""HF ``datasets`` source: local JSON/JSONL/Parquet/text files or a dataset name, streamed,
sharded over the data-parallel ranks by document, tokenized on the fly and packed.

Each rank reads its own share of the documents (``split_dataset_by_node``: whole shards when the
shard count divides the ranks, else every n-th document), so no document is read by two ranks
and none is skipped. Documents are tokenized as ``BOS text EOS``, appended to a rank-local token
buffer and cut into windows of ``seq_len + 1`` tokens that share one token with the next. The
state (documents consumed this epoch, the buffer, the epoch) resumes a run exactly under the same
data-parallel degree. ``datasets`` is imported here only, when this source is used.
"""

from __future__ import annotations

import gzip
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dtrain.assets import resolve
from dtrain.config import ConfigError, DataConfig
from dtrain.data.documents import json_rows, json_type, read_documents, utf8_lines
from dtrain.data.tokenizer import Tokenizer

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
             ".csv": "csv", ".tsv": "tsv", ".arrow": "arrow"}
_TOKENIZE_BATCH = 64  # documents per tokenizer call


def load_documents(cfg: DataConfig):
    """A streaming HF dataset for ``cfg.path``: a file, a folder of files of one format, or a
    dataset name (needs hub access)."""
    import datasets

    local = local_data_files(cfg)
    if local is not None:
        builder, files = local
        # A JSON file pyarrow cannot parse is logged by datasets too; the stream raises one line.
        logging.getLogger("datasets.packaged_modules.json.json").addFilter(_JSON_LOG)
        options = {"delimiter": "\t"} if builder == "tsv" else {}  # HF's csv builder reads it
        return datasets.load_dataset("csv" if builder == "tsv" else builder,
                                     data_files=[str(p) for p in files], split="train",
                                     streaming=True, **options)
    try:
        return datasets.load_dataset(cfg.path, cfg.hf_config or None, split=cfg.hf_split,
                                     streaming=True)
    except Exception as e:  # hub errors come in many types; the user's fix is the same
        raise ConfigError(f"data.path = {cfg.path!r} is neither a local file nor a dataset "
                          f"that could be loaded ({type(e).__name__}: {e}); give a local "
                          "file or folder, or a dataset name reachable from this machine"
                          ) from None


def local_data_files(cfg: DataConfig, key: str = "data.path") -> tuple[str, list[Path]] | None:
    """The HF builder and the files of a local ``cfg.path`` (a file, or a folder of files of one
    format), found without reading them; None for a dataset name (looked up on the hub when the
    data loads). A path written as local (``builtin:``, ``/``, ``./``, ``../``, ``~`` or a data
    file's suffix) that is not there, and files of no or several formats, are a ConfigError
    naming ``key``."""
    value, path = cfg.path, resolve(cfg.path)
    if not path.exists():
        if value.startswith(("builtin:", "/", "./", "../", "~")) or _suffix(path) in _BUILDERS:
            raise ConfigError(f"{key} = {value!r}: no such file or folder: set {key} to a local "
                              f"file or folder ({', '.join(sorted(_BUILDERS))}) or the name of "
                              "a dataset on the HF hub")
        return None
    files = _local_files(path)
    kinds = {_BUILDERS.get(_suffix(p)) for p in files}
    if len(kinds) != 1 or None in kinds:
        raise ConfigError(f"{key} = {value!r}: expected files of one format among "
                          f"{', '.join(sorted(_BUILDERS))}, found "
                          f"{', '.join(sorted({_suffix(p) for p in files})) or 'none'}")
    return kinds.pop(), files


def _local_files(path: Path) -> list[Path]:
    """The files of a local data.path (a file, or the files of a folder); none for a name."""
    if not path.exists():
        return []
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def _suffix(path: Path) -> str:
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return suffixes[-1] if suffixes else ""


class _JsonLoadLog(logging.Filter):
    """Drops datasets' "Failed to load JSON from file" error log (the stream raises a
    ConfigError instead) and keeps the file it names."""

    file: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        match = re.match(r"Failed to load JSON from file '(.*)' with error", record.getMessage())
        if match:
            self.file = match.group(1)
        return match is None


_JSON_LOG = _JsonLoadLog()


def _first_bad_line(files: list[Path], text_field: str, texts: bool = False
                    ) -> ConfigError | None:
    """The ConfigError for the first bad line among the JSON-lines and text ``files`` (the
    file datasets named first): not UTF-8, not a JSON object, or (``texts``) without a string
    ``text_field``; None if there is none."""
    for file in sorted(files, key=lambda p: str(p) != _JSON_LOG.file):
        builder = _BUILDERS.get(_suffix(file))
        if builder == "json" and _is_json_lines(file):
            rows = read_documents(file, text_field) if texts else json_rows(file, text_field)
        elif builder in ("json", "text"):
            rows = utf8_lines(file)
        else:
            continue
        try:
            for _ in rows:
                pass
        except ConfigError as e:
            return e
    return None


def _is_json_lines(file: Path) -> bool:
    """A .json/.jsonl file holding JSON lines, not one JSON array."""
    with (gzip.open if file.suffix == ".gz" else open)(file, "rb") as f:
        return not f.read(4096).lstrip().startswith(b"[")


class HFWindowStream:
    """Windows of ``seq_len + 1`` tokens from this rank's share of the documents."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, dp_rank: int = 0,
                 dp_size: int = 1):
        from datasets.distributed import split_dataset_by_node

        self.cfg, self.tokenizer, self.seq_len = cfg, tokenizer, seq_len
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.dataset = split_dataset_by_node(load_documents(cfg), rank=dp_rank,
                                             world_size=dp_size)
        self.files = _local_files(resolve(cfg.path))  # what the stream reads; none from the hub
        self.epoch, self.documents = 0, 0  # documents consumed in this epoch
        self.documents_read = 0  # over all epochs since construction (for inspection)
        self.buffer: list[int] = []
        self._texts: Iterator[str] | None = None

    def _text_iterator(self) -> Iterator[str]:
        rows = iter(self.dataset.skip(self.documents) if self.documents else self.dataset)
        field = self.cfg.text_field
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as e:  # a local file datasets cannot parse: name its bad line
                error = self._unreadable(e)
                if error is None:
                    raise
                raise error from None
            if field not in row:
                raise ConfigError(f"data.path = {self.cfg.path!r} has no field "
                                  f"'{field}': set data.text_field to one of "
                                  f"{', '.join(row)}")
            text = row[field]
            if not isinstance(text, str):
                files = _local_files(resolve(self.cfg.path))
                raise _first_bad_line(files, field, texts=True) or ConfigError(
                    f"data.path = {self.cfg.path!r} holds a document whose field '{field}' is "
                    f"of type {json_type(text)}, not a string: put the document text there or "
                    "remove that document")
            yield text

    def _unreadable(self, error: Exception) -> ConfigError | None:
        """The ConfigError for a local file datasets failed on with ``error``: one of the files
        the run started with that is gone (datasets reopens every file each epoch, raising a
        FileNotFoundError whose text is the path alone), else the bad line when the file is JSON
        lines or text; None when ``error`` is no data error."""
        import pyarrow as pa

        if isinstance(error, OSError) and (gone := [f for f in self.files if not f.exists()]):
            return ConfigError(f"data file {gone[0]} could not be read during the run (No such "
                               "file or directory): it was moved or deleted; restore it and run "
                               "the same command again (it resumes from the latest checkpoint "
                               "when checkpointing is on)")
        files = _local_files(resolve(self.cfg.path))
        if not files:
            return None
        found = _first_bad_line(files, self.cfg.text_field)
        if found is not None:
            return found
        if not isinstance(error, (ValueError, pa.ArrowException)):
            return None
        where = _JSON_LOG.file if _JSON_LOG.file in {str(p) for p in files} else (
            str(files[0]) if len(files) == 1 else f"a file in {resolve(self.cfg.path)}")
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return ConfigError(f"data.path = {self.cfg.path!r}: HF datasets could not read {where} "
                           f"({reason}): fix that file (JSON lines: one JSON object per line, "
                           f"the text in field '{self.cfg.text_field}')")

    def _refill(self) -> None:
        """Tokenizes the next documents into the buffer, starting a new epoch at the end."""
        if self._texts is None:
            self._texts = self._text_iterator()
        texts = []
        for text in self._texts:
            texts.append(text)
            if len(texts) == _TOKENIZE_BATCH:
                break
        if not texts:
            if self.documents == 0:
                raise ConfigError(f"data.path = {self.cfg.path!r} holds no documents for "
                                  f"data-parallel rank {self.dp_rank} of {self.dp_size}")
            self.epoch, self.documents, self._texts = self.epoch + 1, 0, None
            return
        for ids in self.tokenizer.encode_batch(texts, bos=True, eos=True):
            self.buffer.extend(ids)
        self.documents += len(texts)
        self.documents_read += len(texts)

    def next_window(self) -> np.ndarray:
        while len(self.buffer) < self.seq_len + 1:
            self._refill()
        window = np.asarray(self.buffer[: self.seq_len + 1], dtype=np.int64)
        del self.buffer[: self.seq_len]
        return window

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "documents": self.documents, "buffer": list(self.buffer),
                "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["dp_size"] != self.dp_size:
            raise ConfigError(
                f"the data state was saved with {state['dp_size']} data-parallel ranks and this "
                f"run has {self.dp_size}: streamed HF data resumes only under the same degree "
                "(indexed or text data resume under any)")
        self.epoch, self.documents = state["epoch"], state["documents"]
        self.buffer, self._texts = list(state["buffer"]), None
