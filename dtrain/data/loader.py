"""Packed token windows and the resumable, data-parallel-sharded loaders; ``build_loader`` picks
the recipe's source (text, hf or indexed).

A window is ``seq_len + 1`` tokens: inputs are the first ``seq_len``, labels the last ``seq_len``.
``DataLoader`` serves any indexable window dataset (the text source's ``PackedTokens``, where
documents are tokenized as ``BOS text EOS`` and consecutive windows share one token, and the
indexed source's Megatron sample index). Its window order is fixed for all ranks (a seeded
permutation per epoch, or the dataset's own order); data-parallel rank ``r`` of ``n`` takes its
micro-batch from each consecutive block of ``n * micro_batch`` windows. So every optimizer step
sees the same windows whatever the data-parallel degree, and no window is dropped or repeated
across ranks. ``StreamingLoader`` serves the hf source's rank-local stream.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dtrain.assets import resolve
from dtrain.config import ConfigError, DataConfig
from dtrain.data.documents import read_documents
from dtrain.data.tokenizer import Tokenizer
from dtrain.data.window import WindowDataset


class PackedTokens:
    """A token stream cut into windows of ``seq_len + 1`` tokens."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"the data holds {len(tokens)} tokens, fewer than one window of "
                             f"seq_len + 1 = {seq_len + 1}: use more data or a smaller seq_len")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


def text_file(cfg: DataConfig, key: str = "data.path") -> Path:
    """The text source's file, checked to be there; a ConfigError naming ``key`` if not."""
    path = resolve(cfg.path)
    if not path.is_file():
        raise ConfigError(f"{key}: file {path} not found: set {key} to a .jsonl, .json or text "
                          "file")
    return path


def build_text_dataset(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int,
                       key: str = "data.path") -> PackedTokens:
    """One JSON-lines or text file, tokenized up front and packed (small data)."""
    path = text_file(cfg, key)
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size, cfg.text_field, tokenizer.file_key,
           tokenizer.bos_id, tokenizer.eos_id)
    if key not in _TOKENIZED:  # trainers built one after another in a process tokenize once
        docs = list(read_documents(path, cfg.text_field))
        ids = tokenizer.encode_batch(docs, bos=True, eos=True)
        _TOKENIZED.clear()  # keep one file's tokens at most
        tokens = np.fromiter((t for doc in ids for t in doc), dtype=np.int64)
        tokens.flags.writeable = False  # shared by the trainers that read this file
        _TOKENIZED[key] = tokens
    return PackedTokens(_TOKENIZED[key], seq_len)


# The last text file's tokens, keyed by the file's and the tokenizer's identity and settings.
_TOKENIZED: dict[tuple, np.ndarray] = {}


class DataLoader:
    """Micro-batches ``(inputs, labels)``, each (micro_batch, seq_len) int64, for one
    data-parallel rank. ``state_dict`` holds the global window cursor, so a run resumes where it
    stopped, also under another data-parallel degree with the same global batch: every rank's
    state is the same one (``state_key``)."""

    state_key = "global"

    def __init__(self, dataset: WindowDataset, micro_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 vocab_size: int | None = None, source: str = "the data"):
        self.dataset, self.micro_batch = dataset, micro_batch
        self.vocab_size, self.source = vocab_size, source
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed = 0  # windows taken by all ranks together
        self._order_epoch, self._order = -1, np.arange(0)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order, self._order_epoch = rng.permutation(len(self.dataset)), epoch
        return int(self._order[offset])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.consumed + self.dp_rank * self.micro_batch
        rows = np.stack([self.dataset.window(self._index(start + i))
                         for i in range(self.micro_batch)])
        check_vocab(rows, self.vocab_size, self.source)
        self.consumed += self.dp_size * self.micro_batch
        batch = torch.from_numpy(rows.astype(np.int64))
        return batch[:, :-1], batch[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])


def check_vocab(rows: np.ndarray, vocab_size: int | None, source: str) -> None:
    """Refuses token ids the model has no embedding for (data made with another tokenizer)."""
    if vocab_size is not None and rows.size and (top := int(rows.max())) >= vocab_size:
        raise ConfigError(f"{source} holds token id {top}, outside the tokenizer's vocabulary of "
                          f"{vocab_size}: it was tokenized with another tokenizer; set "
                          "data.tokenizer to that one or re-create the data with this one")


HANDOVER_STOP_S = 2.0  # how long close() waits for a thread handing a batch over to stop


class Prefetcher:
    """Wraps a loader: a background thread fetches the next ``depth`` micro-batches (into pinned
    memory when ``pin_memory``, for asynchronous copies to the GPU) while the model computes.
    ``state_dict`` is the wrapped loader's state after the last batch handed out."""

    def __init__(self, loader: DataLoader | StreamingLoader, depth: int = 2,
                 pin_memory: bool = False):
        self.loader, self.depth, self.pin_memory = loader, depth, pin_memory
        self.state_key, self.dp_size = loader.state_key, loader.dp_size
        self._state = loader.state_dict()
        self._queue: queue.Queue | None = None
        self._stop, self._fetching = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self, handover: queue.Queue, stop: threading.Event, fetching: threading.Event
             ) -> None:
        # Its own queue and events: a thread left behind by close() never touches the next ones.
        while True:
            fetching.set()  # before the stop is read: close() sees the one or this the other
            if stop.is_set():
                fetching.clear()
                return
            try:
                inputs, labels = self.loader.next_batch()
                if self.pin_memory:
                    inputs, labels = inputs.pin_memory(), labels.pin_memory()
                item = (inputs, labels, self.loader.state_dict())
            except BaseException as e:  # handed to the training thread, which raises it
                item = e
            finally:
                fetching.clear()
            while not stop.is_set():
                try:
                    handover.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._queue is None:  # started on first use, so load_state_dict can come first
            self._queue = queue.Queue(maxsize=self.depth)
            self._thread = threading.Thread(
                target=self._run, args=(self._queue, self._stop, self._fetching), daemon=True,
                name="dtrain-prefetch")
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        inputs, labels, self._state = item
        return inputs, labels

    def close(self) -> None:
        """Stops the background thread; batches fetched ahead are dropped and the loader is
        rewound to the state after the last batch handed out, so fetching can start again."""
        if self._thread is None:
            return
        self._stop.set()
        while self._fetching.is_set():  # a fetch in progress finishes before the loader rewinds
            self._thread.join(0.05)
        # Then the thread only hands its batch over, and sees the stop within 0.1 s, unless the
        # queue's lock is lost: a Ctrl-C that lands inside the training thread's get() can leave
        # it held for good (CPython runs the signal's exception between the lock's acquire and
        # its release). That thread, a daemon, is left blocked; it will not touch the loader.
        self._thread.join(HANDOVER_STOP_S)
        self._queue, self._thread = None, None
        self._stop, self._fetching = threading.Event(), threading.Event()
        self.loader.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        if self._queue is not None:
            raise RuntimeError("load the data state before the first batch is fetched")
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()


class StreamingLoader:
    """Micro-batches from a rank-local window stream (the hf source): same interface as
    ``DataLoader``; the state is the stream's, one per data-parallel rank (``state_key``)."""

    def __init__(self, stream, micro_batch: int, dp_rank: int = 0, vocab_size: int | None = None,
                 source: str = "the data"):
        self.stream, self.micro_batch = stream, micro_batch
        self.state_key, self.dp_size = f"dp{dp_rank}", stream.dp_size
        self.vocab_size, self.source = vocab_size, source

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.stream.next_window() for _ in range(self.micro_batch)])
        check_vocab(rows, self.vocab_size, self.source)
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def check_data_path(cfg: DataConfig, key: str = "data.path") -> str:
    """What ``build_loader`` opens first of ``cfg.path``, without reading the data: the text
    source's file; the hf source's local file or folder and its format; each indexed dataset
    of the blend, its index checked. Returns "" or what only loading can check (a hf dataset
    name, looked up on the hub); raises ConfigError naming ``key`` and the fix."""
    if cfg.source == "indexed":
        _open_indexed(cfg, key)
        return ""
    if cfg.source == "hf":
        from dtrain.data.hf import local_data_files

        if local_data_files(cfg, key) is None:
            return (f"{key} = {cfg.path!r}: a dataset name on the HF hub, not checked "
                    "offline (the launch loads it)")
        return ""
    text_file(cfg, key)
    return ""


def _open_indexed(cfg: DataConfig, key: str) -> list:
    """The indexed source's datasets (``blend.open_blend``), a failure naming ``key`` (the
    message names the file)."""
    from dtrain.data.blend import open_blend

    try:
        return open_blend(cfg.path)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None


def build_loader(cfg: DataConfig, tokenizer: Tokenizer, seq_len: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, num_samples: int,
                 split_name: str = "train", key: str = "data.path"
                 ) -> DataLoader | StreamingLoader:
    """The loader for ``cfg.source``. ``num_samples`` (windows the run will take over all
    ranks) sizes the indexed source's sample index; ``split_name`` picks the indexed source's
    train, valid or test documents; ``key`` is the setting ``cfg.path`` came from, named in its
    errors. Token ids are checked against the tokenizer's vocabulary."""
    if cfg.source != "indexed":  # the indexed datasets are opened once, below
        check_data_path(cfg, key)
    checks = {"vocab_size": tokenizer.vocab_size, "source": f"{key} = {cfg.path!r}"}
    if cfg.source == "hf":
        from dtrain.data.hf import HFWindowStream

        return StreamingLoader(HFWindowStream(cfg, tokenizer, seq_len, dp_rank, dp_size),
                               micro_batch, dp_rank, **checks)
    if cfg.source == "indexed":
        from dtrain.data.blend import build_gpt_dataset

        dataset = build_gpt_dataset(cfg.path, seq_len, num_samples, split=cfg.split,
                                    split_name=split_name, seed=seed,
                                    cache_dir=cfg.index_cache or None,
                                    opened=_open_indexed(cfg, key))
        # The sample index is shuffled already (Megatron's order); keep it.
        return DataLoader(dataset, micro_batch, dp_rank, dp_size, seed, shuffle=False, **checks)
    return DataLoader(build_text_dataset(cfg, tokenizer, seq_len, key), micro_batch, dp_rank,
                      dp_size, seed, shuffle=split_name == "train", **checks)
