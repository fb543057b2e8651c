"""Documents from local files, each bad line one ConfigError naming the file and the line: JSON
lines (one object per line, the text in a field) and plain text, .gz allowed. The text source
reads its file through here, and the hf source names a bad line with it when HF datasets fails."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from dtrain.config import ConfigError

TABULAR = (".csv", ".tsv", ".parquet", ".arrow")
"""Table formats the hf source reads by column: as plain text they would train on headers,
separators and quotes."""


def read_documents(path: Path, text_field: str) -> Iterator[str]:
    """Documents from a JSON-lines file (``text_field`` of each line; .gz allowed) or a plain
    text file (one document). A table (``TABULAR``) is refused, naming the hf source."""
    if tabular := next((s for s in path.suffixes if s in TABULAR), None):
        raise ConfigError(f"data.path = {str(path)!r} is a {tabular} table, which the text "
                          "source would read as plain text (headers, separators and quotes "
                          "included): set data.source = 'hf', which reads its columns, and "
                          f"data.text_field to the column that holds the text")
    if ".jsonl" in path.suffixes or ".json" in path.suffixes:
        for line_no, row in json_rows(path, text_field):
            if text_field not in row:
                raise ConfigError(f"{path}:{line_no} has no field '{text_field}': set "
                                  f"data.text_field to one of {', '.join(row)}")
            text = row[text_field]
            if not isinstance(text, str):
                raise ConfigError(not_text(f"{path}:{line_no}", text_field, text))
            yield text
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            for _ in utf8_lines(path):  # raises naming the first line that is not UTF-8
                pass
            raise
        yield text


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line of a UTF-8 text file (.gz allowed); a line that is not
    UTF-8 is a ConfigError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            yield line_no, _decode(raw, path, line_no)


def _decode(raw: bytes, path: Path, line_no: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}:{line_no} is not UTF-8 text (byte {raw[e.start]:#04x}): the "
                          "file must be UTF-8; re-encode it or fix that line") from None


def json_rows(path: Path, text_field: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-empty line of a JSON-lines file (.gz allowed); a line
    that is not UTF-8, not JSON or not a JSON object is a ConfigError naming it."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = _decode(raw, path, line_no)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no} is not valid JSON ({e.msg}): fix or "
                                  "remove that line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{line_no} is a JSON {json_type(row)}, not an "
                                  "object: make each line a JSON object with the text in field "
                                  f"'{text_field}'")
            yield line_no, row


def not_text(where: str, text_field: str, value) -> str:
    """The message for a document whose ``text_field`` holds ``value``, not a string."""
    return (f"{where} has field '{text_field}' of type {json_type(value)}, not a string: put "
            "the document text there or remove that line")


def json_type(value) -> str:
    """``value``'s JSON type name (null, boolean, number, string, array, object)."""
    if value is None:
        return "null"
    for types, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"),
                        ((list, tuple), "array"), (dict, "object")):
        if isinstance(value, types):
            return name
    return type(value).__name__
