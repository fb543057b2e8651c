"""Data throughput: preprocessing (JSON lines -> Megatron .bin/.idx) and the training loaders.

    python tools/bench_data.py --repeat 10 --workers 2

The input is the shipped debug corpus repeated ``--repeat`` times; the tokenizer is the shipped
one. Prints tokens/s for python -m dtrain.preprocess_data, and for the indexed and hf loaders at
seq_len 8192, micro-batch 1 (one Llama 3 8B micro-batch per call).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain.assets import ROOT as ASSETS  # noqa: E402
from dtrain.config import DataConfig  # noqa: E402
from dtrain.data.indexed import IndexedDataset  # noqa: E402
from dtrain.data.loader import build_loader  # noqa: E402
from dtrain.data.tokenizer import Tokenizer  # noqa: E402


def loader_rate(loader, seq_len: int, batches: int) -> float:
    loader.next_batch()  # index building and first reads are not throughput
    start = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    return batches * seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    corpus = (ASSETS / "debug" / "corpus.jsonl").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus.jsonl"
        data.write_text(corpus * args.repeat)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dtrain.preprocess_data",
                        "--input", str(data), "--output-prefix", f"{tmp}/c", "--tokenizer",
                        str(ASSETS / "debug"), "--append-eod", "--workers", str(args.workers)],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - start
        prefix = f"{tmp}/c_text_document"
        tokens = int(IndexedDataset(prefix).sequence_lengths.sum())
        mb = data.stat().st_size / 1e6
        print(f"preprocess: {mb:.1f} MB, {tokens:,} tokens in {seconds:.1f}s = "
              f"{tokens / seconds:,.0f} tokens/s, {mb / seconds:.2f} MB/s "
              f"({args.workers} workers)")
        tokenizer = Tokenizer(ASSETS / "debug")
        for source, path in (("indexed", prefix), ("hf", str(data))):
            cfg = DataConfig(source=source, path=path, index_cache=f"{tmp}/cache")
            loader = build_loader(cfg, tokenizer, args.seq_len, 1, 0, 1, 0,
                                  num_samples=args.batches + 1)
            rate = loader_rate(loader, args.seq_len, args.batches)
            print(f"loader {source}: {rate:,.0f} tokens/s (seq {args.seq_len}, micro-batch 1)")


if __name__ == "__main__":
    main()
