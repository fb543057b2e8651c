"""JSON lines -> Megatron-LM indexed datasets (.bin/.idx), one per JSON key.

    python -m dtrain.preprocess_data --input corpus.jsonl.gz --output-prefix data/corpus \\
        --tokenizer path/to/tokenizer.json --json-keys text --append-eod --workers 8

writes ``data/corpus_text_document.bin`` and ``.idx`` (``{prefix}_{key}_document`` per key, the
names Megatron-LM's tools/preprocess_data.py gives), loadable by Megatron-LM and by
``dtrain.data.indexed.IndexedDataset``. Each line's text becomes one document of one sequence
(no sentence splitting); ``--append-eod`` adds the tokenizer's EOS token to every non-empty
document. Tokens are uint16 for vocabularies under 65,500 entries, else int32.

The input is streamed in chunks of lines through a pool of ``--workers`` processes, with a bounded
number of chunks in flight, so memory stays flat however large the input. Blank lines are
skipped. A line that is not JSON, or lacks a key, stops the run with the file and line number and
exit code 2; outputs are written under temporary names and renamed only at the end, so a failed or
interrupted run leaves no partial dataset.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from dtrain.data.indexed import IndexedDatasetWriter, token_dtype
from dtrain.data.tokenizer import Tokenizer

CHUNK_LINES = 512
CHUNK_BYTES = 4 << 20
"""A chunk of input sent to one worker ends at this many lines or bytes, whichever comes first."""


class InputError(Exception):
    """A user's bad input; the message is printed as one line and the exit code is 2."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl file (.jsonl.gz allowed)")
    parser.add_argument("--output-prefix", required=True,
                        help="output path without suffix; writes PREFIX_KEY_document.bin/.idx")
    parser.add_argument("--tokenizer", "--vocab-file", required=True, dest="tokenizer",
                        help="a tokenizer.json file, or a folder holding one; with "
                             "--merge-file, a GPT-2 vocab.json (Megatron's --vocab-file)")
    parser.add_argument("--merge-file", default=None,
                        help="GPT-2 BPE merges.txt (Megatron's --merge-file), with the "
                             "vocab.json given as --tokenizer")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose text to tokenize, one output dataset each")
    parser.add_argument("--append-eod", action="store_true",
                        help="append the tokenizer's EOS token to every non-empty document")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=1000,
                        help="print progress every this many documents")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.log_interval < 1:
        parser.error("--workers and --log-interval must be >= 1")
    return args


_worker: dict = {}


def init_worker(tokenizer: str, merges: str | None, keys: list[str], append_eod: bool,
                dtype: str, single_process: bool) -> None:
    """Loads the tokenizer once per worker process."""
    if not single_process:
        # Parallelism comes from the worker processes; threads inside each would oversubscribe.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=Tokenizer(tokenizer, merges=merges), keys=keys, append_eod=append_eod,
                   dtype=np.dtype(dtype))


def encode_chunk(chunk: tuple[int, list[bytes]]
                 ) -> tuple[int, int, dict[str, tuple[np.ndarray, np.ndarray]], str | None]:
    """Tokenizes a chunk ``(number of its first line, raw lines)``. Returns (number of
    documents, input bytes, {key: (all tokens, tokens per document)}, error) where error is None
    or ``"N what is wrong"`` for the first bad line N."""
    first_line, lines = chunk
    keys, tokenizer = _worker["keys"], _worker["tokenizer"]
    texts: dict[str, list[str]] = {key: [] for key in keys}
    for line_no, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            return 0, 0, {}, f"{line_no} is not valid JSON ({reason}): fix or remove that line"
        for key in keys:
            value = row.get(key) if isinstance(row, dict) else None
            if not isinstance(value, str):
                found = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                problem = "is not a string" if isinstance(row, dict) and key in row else "missing"
                return 0, 0, {}, (f"{line_no}: key '{key}' {problem} (the line has: {found}): "
                                  "set --json-keys to keys holding text")
            texts[key].append(value)
    out = {}
    for key in keys:
        ids = tokenizer.encode_batch(texts[key])
        if _worker["append_eod"]:
            ids = [doc + [tokenizer.eos_id] if doc else doc for doc in ids]
        lengths = np.fromiter((len(doc) for doc in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter((t for doc in ids for t in doc), dtype=_worker["dtype"],
                           count=int(lengths.sum()))
        out[key] = (flat, lengths)
    return len(texts[keys[0]]), sum(len(line) for line in lines), out, None


def read_chunks(path: Path, slots: threading.Semaphore, stop: threading.Event
                ) -> Iterator[tuple[int, list[bytes]]]:
    """``(first line number, lines)`` chunks of the input, each taken only once a slot is free
    (the consumer releases one per chunk it has written), so few chunks are ever in memory."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        first, lines, size = 1, [], 0
        for line in f:
            lines.append(line)
            size += len(line)
            if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                yield first, lines
                first, lines, size = first + len(lines), [], 0
        if lines and not stop.is_set():
            yield first, lines


def preprocess(args: argparse.Namespace) -> list[str]:
    """Runs the conversion; returns the output prefixes. Raises InputError on bad input."""
    path = Path(args.input)
    if not path.is_file():
        raise InputError(f"--input: file {path} not found: give a .jsonl or .jsonl.gz file")
    try:
        tokenizer = Tokenizer(args.tokenizer, merges=args.merge_file)
    except (FileNotFoundError, ValueError) as e:
        raise InputError(str(e).replace("data.tokenizer", "--tokenizer")
                         .replace("data.merge_file", "--merge-file")) from None
    if args.append_eod and tokenizer.eos_id is None:
        raise InputError(f"--append-eod: tokenizer {args.tokenizer} has no EOS token: set "
                         "eos_token in a tokenizer_config.json beside it, or drop --append-eod")
    dtype = token_dtype(tokenizer.vocab_size)
    prefixes = [f"{args.output_prefix}_{key}_document" for key in args.json_keys]
    init = (args.tokenizer, args.merge_file, args.json_keys, args.append_eod, dtype.str,
            args.workers == 1)
    slots, stop = threading.Semaphore(2 * args.workers + 2), threading.Event()
    chunks = read_chunks(path, slots, stop)
    documents, done_bytes, start = 0, 0, time.monotonic()
    printed = {"documents": 0}

    def progress() -> None:
        printed["documents"] = documents
        elapsed = max(time.monotonic() - start, 1e-9)
        print(f"processed {documents:,} documents ({documents / elapsed:,.0f} docs/s, "
              f"{done_bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)

    with ExitStack() as stack:
        writers = [stack.enter_context(IndexedDatasetWriter(prefix, dtype))
                   for prefix in prefixes]
        if args.workers == 1:
            init_worker(*init)
            results = map(encode_chunk, chunks)
        else:
            pool = stack.enter_context(multiprocessing.Pool(args.workers, init_worker, init))
            stack.callback(stop.set)  # runs before the pool closes: frees a feeder waiting on us
            results = pool.imap(encode_chunk, chunks)
        for count, size, encoded, error in results:
            slots.release()
            if error is not None:
                raise InputError(f"{path}:{error}")
            for writer, key in zip(writers, args.json_keys, strict=True):
                flat, lengths = encoded[key]
                for doc in np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []:
                    writer.add_document(doc)
            documents, done_bytes = documents + count, done_bytes + size
            if documents // args.log_interval > printed["documents"] // args.log_interval:
                progress()
    if documents != printed["documents"] or not documents:
        progress()
    return prefixes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prefixes = preprocess(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
