"""Files shipped with dtrain: the debug corpus and tokenizer (built by tools/make_debug_assets.py).

A config path that starts with ``builtin:`` names a file here, e.g. ``builtin:debug/corpus.jsonl``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def resolve(path: str) -> Path:
    """A ``builtin:`` path inside the shipped assets, or the path itself."""
    return ROOT / path.removeprefix("builtin:") if path.startswith("builtin:") else Path(path)
