"""Megatron-LM indexed datasets: the ``.bin``/``.idx`` pair, and GPT samples drawn from it.

The format is Megatron-LM's ``IndexedDataset`` ("MMIDIDX"), so files written by Megatron's
``tools/preprocess_data.py`` (or ``python -m dtrain.preprocess_data``) load here and files
written here load in Megatron. Checked field by
field against ``megatron/core/datasets/indexed_dataset.py`` (``_IndexWriter``, ``_IndexReader``,
``IndexedDatasetBuilder``, ``DType``) and ``gpt_dataset.py``/``helpers.cpp`` (``GPTDataset``,
``build_sample_idx``) in NVIDIA/Megatron-LM on GitHub:

``.bin``: the tokens of every sequence, back to back, in the token dtype, no header.

``.idx``, little-endian, in this order:

- ``b"MMIDIDX\\x00\\x00"`` (9 bytes), version ``<Q`` = 1, dtype code ``<B`` (``DTYPE_CODES``)
- sequence count S ``<Q``, then document count D ``<Q``, where D is the length of the document
  index array (number of documents + 1; Megatron writes ``len(document_indices)``)
- S sequence lengths (int32, in tokens), S sequence pointers (int64, byte offsets into ``.bin``)
- D document indices (int64): 0, then after each document the number of sequences so far

Megatron's ``preprocess_data.py`` without ``--split-sentences`` writes one sequence per document,
and a document whose text yields no tokens adds a document boundary but no sequence (so
``document_indices`` repeats a value); ``IndexedDatasetWriter.add_document`` does the same. The
token dtype is uint16 when the vocabulary has fewer than 65,500 entries, else int32
(``DType.optimal_dtype``).

``GPTSampleDataset`` reproduces ``GPTDataset``'s document, sample and shuffle indices: the same
``numpy.random.RandomState(seed)`` calls in the same order, so the same seed, documents, sequence
length and sample count give the same samples in the same order as Megatron-LM.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import warnings
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from dtrain.config import ConfigError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D = 34 bytes
DTYPE_CODES: dict[int, np.dtype] = {
    code: np.dtype(name).newbyteorder("<") for code, name in
    {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
     8: "uint16"}.items()}
"""Megatron's ``DType`` enum: the code stored in the index -> the token dtype of ``.bin``."""

_REWRITE = ("re-create it with python -m dtrain.preprocess_data (or copy it again if it was "
            "transferred)")


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65,500 entries, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _dtype_code(dtype: np.dtype) -> int:
    for code, known in DTYPE_CODES.items():
        if known == np.dtype(dtype).newbyteorder("<"):
            return code
    raise ValueError(f"dtype {dtype} has no Megatron DType code; use one of "
                     f"{', '.join(str(d) for d in DTYPE_CODES.values())}")


class IndexedDatasetWriter:
    """Writes ``{prefix}.bin`` and ``{prefix}.idx``. Data goes to temporary files that replace
    the final names only in ``finalize()``, so an interrupted write leaves no half dataset. Use as
    a context manager (finalized on success, discarded on error) or call ``finalize()``."""

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._code = _dtype_code(self.dtype)
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = f"{self.prefix}.bin.{os.getpid()}.tmp"
        self._tmp_idx = f"{self.prefix}.idx.{os.getpid()}.tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = array("q")
        self._document_indices = array("q", [0])

    @property
    def num_documents(self) -> int:
        """Documents added so far, empty ones included."""
        return len(self._document_indices) - 1

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Appends one document as one sequence. An empty document adds a document boundary and
        no sequence, as Megatron's preprocess_data does for text that yields no tokens."""
        values = np.asarray(tokens)
        if values.size:
            if values.ndim != 1:
                raise ValueError(f"a document is a 1-D list of token ids, got shape {values.shape}")
            if self._info is not None and (values.min() < self._info.min
                                           or values.max() > self._info.max):
                raise ValueError(f"token ids {values.min()}..{values.max()} do not fit the "
                                 f"dataset dtype {self.dtype}; use token_dtype(vocab_size)")
            if values.size > np.iinfo(np.int32).max:
                raise ValueError("a sequence holds at most 2**31 - 1 tokens (int32 lengths)")
            self._bin.write(values.astype(self.dtype, copy=False).tobytes())
            self._lengths.append(values.size)
        self._document_indices.append(len(self._lengths))

    def finalize(self) -> None:
        """Writes the index and moves both files to their final names."""
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(INDEX_MAGIC + struct.pack("<Q", INDEX_VERSION) + struct.pack("<B", self._code))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q",
                                                                  len(self._document_indices)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8").tobytes())
        # The old index goes first so that no reader pairs it with the new data.
        Path(f"{self.prefix}.idx").unlink(missing_ok=True)
        os.replace(self._tmp_bin, f"{self.prefix}.bin")
        os.replace(self._tmp_idx, f"{self.prefix}.idx")

    def abort(self) -> None:
        """Discards what was written; the final files (if any existed) are left untouched."""
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            Path(path).unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


CHECK_BLOCK = 1 << 20
"""Index entries checked at a time: temporaries of a few MiB whatever the index's size."""


def open_index(idx_path: Path, bin_path: Path
               ) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Reads the index ``idx_path`` of the data file ``bin_path`` and checks everything Megatron's
    writers guarantee, so a damaged or mismatched pair is refused when opened instead of training
    on wrong tokens or failing mid-run. Returns the token dtype and the sequence lengths (int32),
    sequence pointers (int64) and document indices (int64) as read-only views of the
    memory-mapped index.

    Checked: the header (magic, version, dtype code); the file size, exactly
    ``HEADER_BYTES + 12 * S + 8 * D``; every length >= 0; the pointers back to back from 0, each
    the previous pointer plus the previous length times the token size (every Megatron writer,
    and ``IndexedDatasetWriter``, computes them so); ``bin_path`` exactly as long as the
    sequences; the document indices starting at 0, never decreasing and ending at S. The arrays
    are scanned ``CHECK_BLOCK`` entries at a time with numpy, so an index of billions of
    entries costs one read of the file and temporaries of one block. A failure is a ConfigError
    naming the file, the first bad entry, its value, the value expected and the fix."""
    bin_size = bin_path.stat().st_size
    dtype, count, doc_count = _read_header(idx_path)
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, "<i4", count, HEADER_BYTES)
    pointers = np.frombuffer(raw, "<i8", count, HEADER_BYTES + 4 * count)
    documents = np.frombuffer(raw, "<i8", doc_count, HEADER_BYTES + 12 * count)

    def ends(start: int, stop: int) -> np.ndarray:  # where sequences [start, stop) end in .bin
        return pointers[start:stop] + lengths[start:stop].astype(np.int64) * dtype.itemsize

    def bad_sequences(start: int, stop: int) -> np.ndarray:
        ends_before = ends(max(start - 1, 0), stop - 1)
        expected = ends_before if start else np.concatenate(([0], ends_before))
        return (lengths[start:stop] < 0) | (pointers[start:stop] != expected)

    if (i := _first_flagged(bad_sequences, 0, count)) is not None:
        length, pointer = int(lengths[i]), int(pointers[i])
        if length < 0:
            problem = f"length {length} (a length must be >= 0)"
        else:
            expected = (f"{int(ends(i - 1, i)[0])}, where sequence {i - 1} ends: sequences "
                        "lie back to back" if i else f"0, the start of {bin_path.name}")
            past = (f"; {pointer} lies outside {bin_path.name}, which holds {bin_size} bytes"
                    if not 0 <= pointer <= bin_size else "")
            problem = f"pointer {pointer} (expected {expected}){past}"
        raise ConfigError(f"index {idx_path}, sequence {i}: {problem}; {_REWRITE}")
    end = int(ends(count - 1, count)[0]) if count else 0
    if bin_size < end:
        raise ConfigError(f"{bin_path} is truncated: it holds {bin_size} bytes, its index "
                          f"{idx_path.name} describes {end}; {_REWRITE}")
    if bin_size > end:
        raise ConfigError(f"{bin_path} holds {bin_size} bytes, more than the {end} its index "
                          f"{idx_path.name} describes: the two files do not belong together; "
                          f"{_REWRITE}")
    _check_documents(idx_path, documents, count)
    return dtype, lengths, pointers, documents


def _read_header(idx_path: Path) -> tuple[np.dtype, int, int]:
    """The token dtype, sequence count and document-index count of an index whose header and
    size are what Megatron writes."""
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if not INDEX_MAGIC.startswith(header[:len(INDEX_MAGIC)]):
        raise ConfigError(f"{idx_path} is not a Megatron MMIDIDX index (it starts with "
                          f"{header[:9]!r}); {_REWRITE}")
    if len(header) < HEADER_BYTES:
        raise ConfigError(f"{idx_path} is truncated ({idx_size} bytes, the header alone is "
                          f"{HEADER_BYTES}); {_REWRITE}")
    version, code, count, doc_count = struct.unpack("<QBQQ", header[9:])
    if version != INDEX_VERSION:
        raise ConfigError(f"{idx_path} has index version {version} (only version "
                          f"{INDEX_VERSION} exists); {_REWRITE}")
    if code not in DTYPE_CODES:
        raise ConfigError(f"{idx_path} has unknown dtype code {code} (known: "
                          f"{', '.join(map(str, DTYPE_CODES))}); {_REWRITE}")
    needed = HEADER_BYTES + 12 * count + 8 * doc_count
    if idx_size != needed:
        state = "is truncated" if idx_size < needed else "holds more than its header describes"
        # Megatron's multimodal indices append one mode byte per sequence.
        modes = (", one byte per sequence more: a multimodal index, which dtrain does not read"
                 if count and idx_size == needed + count else "")
        raise ConfigError(f"{idx_path} {state}: {count} sequences and {doc_count} document "
                          f"indices take {needed} bytes, the file has {idx_size}{modes}; "
                          f"{_REWRITE}")
    if doc_count == 0:
        raise ConfigError(f"{idx_path} has no document indices (Megatron writes at least the "
                          f"leading 0); {_REWRITE}")
    return DTYPE_CODES[code], count, doc_count


def _check_documents(idx_path: Path, documents: np.ndarray, count: int) -> None:
    """Document indices start at 0, never decrease and end at the sequence count."""
    doc_count = len(documents)

    def bad_documents(start: int, stop: int) -> np.ndarray:
        values = documents[start:stop]
        return (values < documents[start - 1:stop - 1]) | (values > count)

    if documents[0] != 0:
        i, problem = 0, "expected 0"
    elif (i := _first_flagged(bad_documents, 1, doc_count)) is not None:
        problem = (f"expected at most {count}, the sequence count" if documents[i] > count
                   else f"expected at least {documents[i - 1]}, the index before it: document "
                        "indices never decrease")
    elif documents[-1] != count:
        i, problem = doc_count - 1, f"expected {count}, the sequence count, as the last index"
    else:
        return
    raise ConfigError(f"index {idx_path}, document index {i}: {documents[i]} ({problem}); "
                      f"{_REWRITE}")


def _first_flagged(flags: Callable[[int, int], np.ndarray], start: int, stop: int) -> int | None:
    """The first ``i`` in ``[start, stop)`` that ``flags(begin, end)`` (a bool array over
    ``[begin, end)``) marks, scanning ``CHECK_BLOCK`` entries at a time; None if none is."""
    for begin in range(start, stop, CHECK_BLOCK):
        marked = flags(begin, min(begin + CHECK_BLOCK, stop))
        if marked.any():
            return begin + int(np.argmax(marked))
    return None


class IndexedDataset:
    """Memory-mapped reader of ``{prefix}.bin``/``{prefix}.idx``. ``ds[i]`` is sequence ``i`` as
    a read-only numpy array in the file's token dtype. A missing, corrupt or truncated file raises
    ``ConfigError`` naming the file and the fix."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{self.prefix}.idx"), Path(f"{self.prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise ConfigError(f"indexed dataset file {path} not found: give the prefix "
                                  "without .bin/.idx, or create the dataset with "
                                  "python -m dtrain.preprocess_data")
        (self.dtype, self.sequence_lengths, self.sequence_pointers,
         self.document_indices) = open_index(idx_path, bin_path)
        self._bin = (np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_path.stat().st_size
                     else np.zeros(0, dtype=np.uint8))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``index`` (to its end when length is
        None), as a read-only view of the memory-mapped ``.bin``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} out of range for {len(self)} sequences")
        size = int(self.sequence_lengths[index])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence "
                             f"{index} of {size} tokens")
        start = int(self.sequence_pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_documents(self) -> int:
        """Documents in the dataset (``len`` counts sequences; empty documents have none)."""
        return len(self.document_indices) - 1

    def __getstate__(self) -> dict[str, str]:
        return {"prefix": self.prefix}  # memory maps do not pickle; reopen in the new process

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["prefix"])


def split_ranges(split: str, num_documents: int) -> list[range]:
    """Train/valid/test document ranges for a Megatron ``--split`` string such as ``"969,30,1"``.

    Weights (1 to 3, missing ones are 0) are normalised; split ``i`` covers
    ``[round(c_i * n), round(c_{i+1} * n))`` for the cumulative weights ``c`` and
    ``n = num_documents``, Megatron's arithmetic (Python ``round``, float64). For GPT data Megatron
    splits by sequence; with one sequence per document the two are the same. A zero-weight split is
    an empty range."""
    try:
        weights = [float(x) for x in re.split(r"[,/\s]+", split.strip()) if x]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(f"split '{split}' must be 1 to 3 non-negative weights for train, valid "
                          "and test with a positive sum, e.g. '969,30,1'")
    vector = np.array(weights + [0.0] * (3 - len(weights)), dtype=np.float64)
    vector = (vector / np.sum(vector)).tolist()
    bounds = [0.0]
    for weight in vector:
        bounds.append(bounds[-1] + weight)
    ranges = []
    for begin, end in zip(bounds[:-1], bounds[1:], strict=True):
        first = int(round(begin * float(num_documents)))
        ranges.append(range(first, int(round(end * float(num_documents))) if end > begin
                            else first))
    return ranges


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """Document ids repeated ``num_epochs`` times and shuffled as one array (int32), or, when
    ``separate_final_epoch``, the first ``num_epochs - 1`` epochs and the last one shuffled
    apart (Megatron's ``_build_document_index``)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int64), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate((first, build_document_index(documents, 1, rng, False)))


def build_sample_index(sequence_lengths: np.ndarray, document_index: np.ndarray, seq_len: int,
                       num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2) int64: row ``j`` is (position in ``document_index``, token offset)
    where sample ``j`` starts; sample ``j`` ends at row ``j + 1`` inclusive, so it holds
    ``seq_len + 1`` tokens and shares its last token with the next sample. Sample ``j`` starts
    at token ``j * seq_len`` of the documents concatenated in ``document_index`` order; a token
    that closes a document is found in that document, not at offset 0 of the next
    (``build_sample_idx`` in Megatron's helpers.cpp, vectorised)."""
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    position = np.searchsorted(ends, starts, side="right")
    sample_index = np.stack((position, starts - ends[position] + lengths[position]), axis=1)
    sample_index[0] = 0
    return sample_index


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of ``[0, total)`` that shuffles ``[0, num_samples)`` and
    ``[num_samples, total)`` apart (Megatron's ``_build_shuffle_index``)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTSampleDataset:
    """Samples of ``seq_len + 1`` tokens drawn from the given documents of an IndexedDataset,
    Megatron's ``GPTDataset``: documents are concatenated in a seeded shuffled order over as many
    epochs as ``num_samples`` needs (one epoch when None), cut into samples that span document
    boundaries and overlap by one token, and the samples are shuffled. ``len`` is the number of
    samples built (at least ``num_samples``); ``window(i)`` is sample ``i``.

    The three index arrays are cached as .npy files in ``cache_dir`` (default: ``index_cache/``
    beside the data), named by a hash of the dataset, documents, seq_len, num_samples and seed, and
    loaded (memory-mapped) instead of rebuilt when present."""

    def __init__(self, dataset: IndexedDataset, documents: range | Sequence[int] | np.ndarray,
                 seq_len: int, num_samples: int | None = None, seed: int = 1234,
                 cache_dir: str | Path | None = None):
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        ids = np.asarray(documents, dtype=np.int64)
        if len(ids) == 0:
            raise ConfigError(f"no documents of {dataset.prefix} in this split: give the split "
                              "more weight or use more data")
        if ids.min() < 0 or ids.max() >= len(dataset):
            raise ConfigError(f"document ids {ids.min()}..{ids.max()} out of range for "
                              f"{dataset.prefix} with {len(dataset)} sequences")
        if seq_len < 1 or (num_samples is not None and num_samples < 1):
            raise ConfigError(f"seq_len ({seq_len}) and num_samples ({num_samples}) must be >= 1")
        self.tokens_per_epoch = int(np.sum(dataset.sequence_lengths[ids], dtype=np.int64))
        if self.tokens_per_epoch == 0 or (num_samples is None and self.tokens_per_epoch <= seq_len):
            raise ConfigError(f"{dataset.prefix}: this split holds {self.tokens_per_epoch} "
                              f"tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}: "
                              "use more data, a larger split or a smaller seq_len")
        self.num_samples = num_samples
        description = {
            "class": "GPTSampleDataset", "format": 1,
            "prefix": str(Path(dataset.prefix).resolve()), "sequences": len(dataset),
            "documents": (f"range({documents.start}, {documents.stop})"
                          if isinstance(documents, range) and documents.step == 1
                          else hashlib.md5(ids.tobytes()).hexdigest()),
            "tokens_per_epoch": self.tokens_per_epoch, "seq_len": seq_len,
            "num_samples": num_samples, "seed": seed}
        directory = Path(cache_dir) if cache_dir else Path(dataset.prefix).parent / "index_cache"
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        self.cache_prefix = directory / f"{Path(dataset.prefix).name}-{key}"
        names = ("document_index", "sample_index", "shuffle_index")
        paths = [Path(f"{self.cache_prefix}-{name}.npy") for name in names]
        self.loaded_from_cache = all(p.is_file() for p in paths)
        if self.loaded_from_cache:
            arrays = [np.load(p, mmap_mode="r") for p in paths]
        else:
            arrays = list(self._build(ids))
            _save_cache(self.cache_prefix, dict(zip(names, arrays, strict=True)), description)
        self.document_index, self.sample_index, self.shuffle_index = arrays

    def _build(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, seq_len = self.tokens_per_epoch, self.seq_len
        num_epochs = 1
        if self.num_samples is not None:  # enough epochs for num_samples windows of seq_len + 1
            num_epochs = max(1, -(-(self.num_samples * seq_len + 1) // tokens))
        separate_final_epoch = False
        if num_epochs > 1:
            # A final epoch used less than 80% is shuffled on its own, so that the earlier,
            # complete epochs are not diluted by it (Megatron's rule).
            before_final = ((num_epochs - 1) * tokens - 1) // seq_len
            per_epoch = (tokens - 1) // seq_len
            separate_final_epoch = self.num_samples - before_final < int(0.8 * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(ids, num_epochs, rng, separate_final_epoch)
        total = (num_epochs * tokens - 1) // seq_len
        sample_index = build_sample_index(self.dataset.sequence_lengths, document_index, seq_len,
                                          total)
        shuffle_index = build_shuffle_index(before_final if separate_final_epoch else total,
                                            total, rng)
        return document_index, sample_index, shuffle_index

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def window(self, index: int) -> np.ndarray:
        """Sample ``index``: ``seq_len + 1`` tokens in the dataset's token dtype."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        sample = int(self.shuffle_index[index])
        (first, offset), (last, end) = self.sample_index[sample], self.sample_index[sample + 1]
        get, docs = self.dataset.get, self.document_index
        if first == last:
            return get(int(docs[first]), int(offset), int(end - offset + 1))
        parts = [get(int(docs[first]), int(offset))]
        parts += [get(int(docs[i])) for i in range(first + 1, last)]
        parts.append(get(int(docs[last]), 0, int(end) + 1))
        return np.concatenate(parts)


def _save_cache(prefix: Path, arrays: dict[str, np.ndarray], description: dict) -> None:
    """Writes each array to ``{prefix}-{name}.npy`` through a temporary file and a rename, so
    ranks building the same cache at once never read a partial file. An unwritable folder only
    costs the cache."""
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        for name, values in arrays.items():
            tmp = f"{prefix}-{name}.{socket.gethostname()}-{os.getpid()}.tmp"
            with open(tmp, "wb") as f:  # a file object, so np.save adds no .npy suffix
                np.save(f, values)
            os.replace(tmp, f"{prefix}-{name}.npy")
        Path(f"{prefix}-description.json").write_text(json.dumps(description, indent=2))
    except OSError as e:
        warnings.warn(f"could not cache sample indices in {prefix.parent} ({e.strerror}); they "
                      "will be rebuilt on every start: pass cache_dir= a writable folder",
                      stacklevel=3)
