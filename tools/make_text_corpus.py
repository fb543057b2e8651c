"""Builds a text corpus from files on this machine, for loss comparisons that must not repeat
their data: ``train.jsonl`` and ``valid.jsonl`` (one JSON line per document, field "text"), the
validation part held out by whole documents.

Documents: the JSON lines of ``--base`` files, if given, then Python sources of the installed
site-packages (files of 2,000 to 200,000 characters, no tests or vendored copies, in an order
shuffled with seed 1) until ``--extra-chars`` characters are added. All of it is shuffled with
seed 0 and documents from the end are held out until ``--valid-chars`` are.

    python tools/make_text_corpus.py --out .bench/natural2 --base .bench/natural/data.jsonl

docs/benchmarks.md's held-out FP8 comparison used that command, its ``--base`` holding Python
3.11's standard library sources (no tests) and Vim 9.0's documentation, shuffled with seed 0.
"""

import argparse
import glob
import json
import random
import site
from pathlib import Path


def site_sources(limit: int) -> list[str]:
    files = sorted(f for root in site.getsitepackages()
                   for f in glob.glob(root + "/**/*.py", recursive=True)
                   if "/test" not in f and "/_vendor" not in f)
    random.Random(1).shuffle(files)
    texts, total = [], 0
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 2000 < len(text) < 200_000:
            texts.append(text)
            total += len(text)
        if total > limit:
            break
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--base", nargs="*", default=[], type=Path,
                        help="JSON-lines files whose documents come first")
    parser.add_argument("--extra-chars", type=int, default=14_000_000)
    parser.add_argument("--valid-chars", type=int, default=1_000_000)
    args = parser.parse_args()
    docs = [json.loads(line)["text"] for path in args.base for line in path.open()]
    docs += site_sources(args.extra_chars)
    random.Random(0).shuffle(docs)
    valid, held = [], 0
    while held < args.valid_chars and docs:
        valid.append(docs.pop())
        held += len(valid[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", docs), ("valid", valid)):
        with (args.out / f"{name}.jsonl").open("w") as f:
            for doc in part:
                f.write(json.dumps({"text": doc}) + "\n")
        print(f"{name}: {len(part)} documents, {sum(map(len, part)):,} characters")


if __name__ == "__main__":
    main()
