"""What a checkpoint's files must pass: enough free space before they are written, a content
hash of each recorded while it is written (no second read), the hashes checked and the model's
keys compared with the saved ones before anything is loaded.

Each rank's hashes go into ``hashes-rank<R>.json`` inside the checkpoint folder (file name ->
xxh3-64 hex digest and size). A resume checks every file the checkpoint's metadata names (the
ranks share the files between them) and names the first one that differs or has no record.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from dtrain.config import ConfigError
from dtrain.dtensor import local

GIB = 2**30


class _HashingStream:
    """A file being written, with every byte also fed to ``digest``."""

    def __init__(self, raw, digest):
        self._raw, self._digest = raw, digest
        self.size = 0

    def write(self, data) -> int:
        self._digest.update(data)
        self.size += memoryview(data).nbytes
        return self._raw.write(data)

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP's file system, recording the hash and size of every file written through it
    (``hashes``, by file name; a rename carries its entry along)."""

    def __init__(self):
        super().__init__()
        self.hashes: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream, xxhash.xxh3_64())
            yield hashing
        self.hashes[Path(path).name] = {"xxh3_64": hashing._digest.hexdigest(),
                                        "bytes": hashing.size}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        if (entry := self.hashes.pop(Path(path).name, None)) is not None:
            self.hashes[Path(new_path).name] = entry


def hashing_writer(path: Path) -> tuple[dcp.FileSystemWriter, HashingFileSystem]:
    """A DCP writer into ``path`` whose files are hashed as they are written."""
    writer = dcp.FileSystemWriter(str(path))
    writer.fs = HashingFileSystem()
    return writer, writer.fs


def write_hashes(folder: Path, rank: int, fs: HashingFileSystem) -> None:
    (folder / f"hashes-rank{rank}.json").write_text(json.dumps(fs.hashes, indent=0))


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def verify_hashes(folder: Path, what: str) -> None:
    """Compares every file of the checkpoint (the shards its ``.metadata`` names, and the
    ``.metadata`` itself) with the hash recorded when it was written; the ranks share the work.
    Raises ConfigError on every rank naming the first file that is damaged, missing, or has no
    readable hash record (``checkpoint.load_unverified`` loads such a checkpoint anyway)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem, entries = _hash_records(folder)
    for name, entry in (entries[rank::world] if not problem else []):
        path = folder / name
        if entry is None:
            problem = (f"file {path} has no recorded hash (a hashes-rank*.json file is missing, "
                       "or the checkpoint was written by an older dtrain)")
        elif not path.is_file():
            problem = f"file {path} is missing"
        elif path.stat().st_size != entry["bytes"] or file_hash(path) != entry["xxh3_64"]:
            problem = f"file {path} is damaged (its content differs from when it was written)"
        if problem:
            break
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    if found := next((p for p in problems if p), None):
        raise ConfigError(f"{what} cannot be loaded: {found}. Delete that checkpoint folder to "
                          "resume from the one before, set checkpoint.load_step, or set "
                          "checkpoint.load_unverified = true to load it unchecked")


def _hash_records(folder: Path) -> tuple[str, list[tuple[str, dict | None]]]:
    """(a problem, or ""; each file the checkpoint needs with its recorded hash entry, None
    where no record has one)."""
    recorded: dict[str, dict] = {}
    for record in sorted(folder.glob("hashes-rank*.json")):
        try:
            entries = json.loads(record.read_text())
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return f"its hash record {record} cannot be read ({type(e).__name__})", []
        recorded.update(entries)
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception:  # check_keys, which runs first, names this problem
        return "", []
    needed = {item.relative_path for item in (metadata.storage_data or {}).values()}
    needed.add(".metadata")
    return "", [(name, recorded.get(name)) for name in sorted(needed)]


def describe_write_error(error: BaseException) -> str:
    """What a failed checkpoint write means, in the user's words: a full disk, a read-only
    one, or the error's first line (torch's file writer reports a full disk as a short write,
    "unexpected pos", without an errno)."""
    code = getattr(error, "errno", None)
    text = (str(error).strip().splitlines() or [""])[0]
    if code == errno.ENOSPC or "unexpected pos" in text or "No space left" in text:
        return "the disk is full (No space left on device)"
    if code == errno.EROFS or "Read-only file system" in text:
        return "the file system is read-only"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied ({text})"
    return f"{type(error).__name__}: {text}"[:500]


def checkpoint_keys(path: Path, what: str, fix: str) -> set[str]:
    """The flattened keys of the checkpoint at ``path``, read from its ``.metadata`` (the first
    thing a load reads). A path that is not there, or a checkpoint without readable metadata, is
    one ConfigError naming ``what``, then ``fix``."""
    if not path.exists():
        raise ConfigError(f"{what} cannot be loaded: {path} does not exist. {fix}")
    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except FileNotFoundError:
        raise ConfigError(f"{what} cannot be loaded: {path} has no .metadata (not a checkpoint, "
                          f"or its save did not finish). {fix}") from None
    except Exception as e:  # unreadable metadata: one line, not the unpickler's traceback
        raise ConfigError(f"{what} cannot be loaded: its .metadata is damaged "
                          f"({type(e).__name__}). {fix}") from None


def check_keys(state: dict[str, Any], path: Path, what: str, fix: str) -> None:
    """Refuses a checkpoint without metadata (``checkpoint_keys``), or whose ``model`` entry
    holds keys the model does not have or lacks keys it has (DCP alone checks only the keys it
    is asked for)."""
    saved = checkpoint_keys(path, what, fix)
    wanted = {f"model.{key}" for key in state["model"]}
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold parts
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, wanted)
        wanted = set().union(*every)
    saved_model = {key for key in saved if key.startswith("model.")}
    if wanted == saved_model:
        return
    extra, missing = sorted(saved_model - wanted), sorted(wanted - saved_model)
    listed = "; ".join(part for part in (
        f"{len(extra)} keys the model does not have (first {extra[0]})" if extra else "",
        f"{len(missing)} of the model's keys are missing (first {missing[0]})" if missing else "")
        if part)
    raise ConfigError(f"{what} cannot be loaded: it was saved for another model shape: {listed}. "
                      f"{fix}")


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors (local shards) in a state dict."""
    total = 0
    for value in leaves(state):
        if isinstance(value, torch.Tensor):
            shard = local(value)
            total += shard.numel() * shard.element_size()
    return total


def leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def free_bytes(folder: Path) -> int:
    """Free bytes on the file system that holds ``folder`` (or its nearest existing parent)."""
    path = folder
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free
