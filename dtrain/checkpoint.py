"""Distributed checkpoints with torch DCP: save, resume, resharding across layouts, async save.

A checkpoint is a folder ``<run>/<checkpoint.folder>/step-0000100`` holding DCP's shards: the
model and optimizer state keyed by the whole model's parameter names (pipeline stages, FSDP and
TP shards all map to the same names, so a checkpoint saved under one layout loads under any
other), the LR schedule, the step, the data loader's position and each rank's random-number
generator states (restored when the world size is unchanged). It is written under a
``.tmp`` name and renamed when every rank has finished, so a crash mid-save leaves the previous
checkpoint as the latest usable one.

Module extra states (Transformer Engine's FP8 scaling state, ``fp8.backend = "te"``: a serialised
tensor whose size depends on its contents) are kept out of ``model``, whose keys are then the same
for every FP8 backend and for bf16, and saved as bytes under ``fp8_meta``: a checkpoint of one
backend loads into the others, and a TE run resumes its scaling state where the checkpoint has
it (a run from a torchao or bf16 checkpoint starts TE's afresh).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from dtrain.checkpoint_files import (
    GIB,
    check_keys,
    checkpoint_keys,
    describe_write_error,
    free_bytes,
    hashing_writer,
    state_bytes,
    verify_hashes,
    write_hashes,
)
from dtrain.checkpoint_state import (
    finite_state,
    model_state,
    restorable_extra,
    rng_state,
    set_rng_state,
    with_extra,
)
from dtrain.config import CheckpointConfig, ConfigError
from dtrain.hooks import StepHook
from dtrain.log import logger

_STEP = re.compile(r"^step-(\d+)$")
# How a write that failed reaches us: DCP's exception wrapping each rank's (every rank gets it),
# an OSError (ENOSPC, EIO, ...), or torch's file writer's RuntimeError after a short write.
WRITE_ERRORS = (CheckpointException, OSError, RuntimeError)


def whole_model_view(parts: list[nn.Module]) -> nn.Module:
    """One module whose parameter names are the whole model's, over this rank's stages (the
    modules are shared, not copied). A single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()
    view.layers = nn.ModuleDict({k: v for part in parts for k, v in part.layers.items()})
    for name in ("tok_embeddings", "norm", "output", "mtp"):
        module = next((getattr(p, name) for p in parts if getattr(p, name) is not None), None)
        if module is not None:
            setattr(view, name, module)
    return view


def checkpoint_steps(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, ascending."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _STEP.match(p.name)))


def resumable(cfg: CheckpointConfig, run_dir: Path) -> bool:
    """Whether a run with ``cfg`` in ``run_dir`` will resume from a checkpoint there."""
    return cfg.enabled and bool(checkpoint_steps(checkpoint_folder(cfg, run_dir)))


def checkpoint_folder(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run's checkpoints go: ``cfg.folder`` inside the run folder, or as given when it
    is absolute."""
    return Path(cfg.folder) if Path(cfg.folder).is_absolute() else run_dir / cfg.folder


class Checkpointer(StepHook):
    """Saves every ``cfg.interval`` steps and at the last of ``total_steps`` (``should_save``),
    keeps the last ``keep_last``, and resumes from the latest (or ``cfg.load_step``) at start-up.
    As a step hook it holds the weights' update until an asynchronous save has copied them.
    The loader's state is saved under its ``state_key`` ("global", or "dp<rank>" for a
    rank-local stream), beside ``data_settings`` (what that position means: the data's
    source, path, tokenizer, sequence length...), which a resume must match."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer, scheduler, loader, total_steps: int,
                 cpu_group: dist.ProcessGroup | None = None,
                 data_settings: dict[str, str] | None = None):
        self.cfg, self.total_steps, self.cpu_group = cfg, total_steps, cpu_group
        self.saved_step = 0  # the step of the last save begun (0: none)
        self.not_saved = ""  # why the last save failed or was skipped ("" after a good one)
        self.folder = checkpoint_folder(cfg, run_dir)
        self.model = whole_model_view(parts)
        self.optimizer, self.scheduler, self.loader = optimizer, scheduler, loader
        self.data_key, self.data_settings = loader.state_key, data_settings or {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # The background write's collectives (DCP's plan and metadata exchange) on a group of
        # their own: on the training's group they interleave with its collectives (gloo then
        # reports a mismatch or hangs).
        self._save_group = dist.new_group(backend="gloo") \
            if cfg.async_save and dist.is_initialized() and dist.get_world_size() > 1 else None
        self._pending: tuple[Future, Path] | None = None
        self._staging: Future | None = None
        self._stager = None

    def describe(self) -> str:
        return (f"checkpoints: every {self.cfg.interval} steps"
                f"{' (async)' if self.cfg.async_save else ''}, last {self.cfg.keep_last} kept")

    def should_save(self, step: int) -> bool:
        return step % self.cfg.interval == 0 or step == self.total_steps

    def before_update(self) -> None:
        self.wait_staged()  # an async save may still be copying the weights

    def _async_stager(self) -> DefaultStager:
        """A stager for one save: copies the state to host buffers (pinned on a GPU) on a
        background thread, so the training pauses only if it reaches the optimizer step before
        the copy ends. A new one each save, closed once the save is written: torch 2.11's
        stager empties its copy table after each copy, and its next copy fails."""
        self._release_stager()  # one left by a save that failed to start
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
            use_non_blocking_copy=cuda))
        return self._stager

    def _state(self, step: int) -> dict[str, Any]:
        return {
            **model_state(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "train": {"step": step, "scheduler": self.scheduler.state_dict(),
                      f"data_{self.data_key}": self.loader.state_dict(),
                      "data_settings": json.dumps(self.data_settings, sort_keys=True),
                      "rng": {f"rank{self.rank}": rng_state()}},
        }

    def save(self, step: int) -> None:
        """Writes the checkpoint of ``step`` (asynchronously with ``cfg.async_save``: the
        training continues while the files are written; the rename happens at the next save or
        at ``close``) and logs how long the training paused for it."""
        start = time.perf_counter()
        self.wait()
        if self._save(step):
            self.saved_step, self.not_saved = step, ""
            logger.info(f"checkpoint step {step}: training paused "
                        f"{time.perf_counter() - start:.2f}s"
                        + (" (written in the background)" if self.cfg.async_save else ""))

    def _save(self, step: int) -> bool:
        """Begins the save of ``step`` unless the state is not finite or the disk too full
        (one line says so, the previous checkpoint stays the latest); whether it began."""
        tmp = self.folder / f"step-{step:07d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crash
        self._barrier()
        state = self._state(step)
        if not self._agree(finite_state(state)):
            self._skipped(step, "the weights or the optimizer state are not finite")
            return False
        need = self._sum(state_bytes(state))
        free = free_bytes(self.folder)
        if not self._agree(free >= need):
            self._skipped(step, f"{self.folder} has {free / GIB:.2f} GiB free and the "
                                f"checkpoint needs {need / GIB:.2f} GiB")
            return False
        writer, self._files = hashing_writer(tmp)
        try:
            with _quiet():
                if self.cfg.async_save:
                    result = dcp.async_save(state, storage_writer=writer,
                                            process_group=self._save_group,
                                            async_stager=self._async_stager())
                else:
                    dcp.save(state, storage_writer=writer)
        except WRITE_ERRORS as e:
            self._failed(tmp, e)
            return False
        if not self.cfg.async_save:
            self._finish(tmp)
            return True
        if isinstance(result, AsyncSaveResponse):
            self._staging, result = result.staging_completion, result.upload_completion
        self._pending = (result, tmp)
        return True

    def _skipped(self, step: int, why: str) -> None:
        latest = checkpoint_steps(self.folder)
        self.not_saved = why
        logger.warning(f"checkpoint step {step} not saved: {why}; "
                       + (f"step {latest[-1]} stays the latest checkpoint" if latest else
                          "there is no earlier checkpoint") + "; training goes on")

    def _failed(self, tmp: Path, error: BaseException) -> None:
        """A write that failed on any rank (every rank gets DCP's exception): its partial
        files are removed."""
        self._barrier()
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        step = _step_of(tmp)
        if self.saved_step == step:
            self.saved_step = 0
        self._skipped(step, f"writing {tmp} failed: {describe_write_error(_root(error))} "
                            f"({free_bytes(self.folder) / GIB:.2f} GiB free there); its "
                            "partial files were removed")

    def _agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok``."""
        return self._sum(0 if ok else 1) == 0

    def _sum(self, value: int) -> int:
        """``value`` summed over the ranks (over the CPU group, or the default one on CPU)."""
        group = self.cpu_group
        if group is None and not (dist.is_initialized() and dist.get_backend() == "gloo"):
            return value
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        return int(total.item())

    def wait_staged(self) -> None:
        """Waits until an asynchronous save has copied the state off the device: call before
        anything changes the parameters or optimizer state in place."""
        if self._staging is not None:
            self._staging.result()
            self._staging = None

    def wait(self) -> None:
        """Completes an asynchronous save in flight."""
        self.wait_staged()
        if self._pending is not None:
            future, tmp = self._pending
            self._pending = None
            try:
                future.result()
            except WRITE_ERRORS as e:
                self._failed(tmp, e)
                return
            finally:
                self._release_stager()
            self._finish(tmp)

    def _release_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def close(self) -> None:
        """Completes a save in flight and frees its staging buffers."""
        self.wait()
        self._release_stager()

    def _finish(self, tmp: Path) -> None:
        error = None
        try:
            write_hashes(tmp, self.rank, self._files)
        except OSError as e:  # the shards are written but cannot be verified: not kept
            error = e
        # Every rank decides together (a rank alone in _failed would wait at another barrier).
        if not self._agree(error is None):
            self._failed(tmp, error or OSError("another rank could not record its files' "
                                               "hashes"))
            return
        self._barrier()  # every rank has written its shards
        if self.rank == 0:
            final = tmp.with_name(tmp.name.removesuffix(".tmp"))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            self._rotate(_step_of(tmp))
        self._barrier()

    def _rotate(self, newest: int) -> None:
        """Deletes all but the last ``keep_last`` checkpoints, the one just written (``newest``)
        always kept whatever its step number."""
        if not self.cfg.keep_last:
            return
        others = [s for s in checkpoint_steps(self.folder) if s != newest]
        for old in others[: max(0, len(others) - (self.cfg.keep_last - 1))]:
            shutil.rmtree(self.folder / f"step-{old:07d}", ignore_errors=True)

    def _barrier(self) -> None:
        """All ranks here (over the CPU group where there is one: no device synchronisation)."""
        if dist.is_initialized():
            dist.barrier(group=self.cpu_group)

    def load(self) -> int:
        """Restores the latest checkpoint (or ``cfg.load_step``); returns its step, or 0 when
        there is none. A damaged or mismatched checkpoint raises ConfigError, loading nothing
        into the model and optimizer. Resuming an earlier step than the latest moves the later
        checkpoints aside (kept), so that the next resume continues this branch."""
        start = time.perf_counter()
        steps = checkpoint_steps(self.folder)
        step = self._load(steps)
        self.saved_step = step  # that step's checkpoint exists
        if step:
            logger.info(f"checkpoint step {step} loaded in {time.perf_counter() - start:.2f}s"
                        + (" without verifying its files (checkpoint.load_unverified)"
                           if self.cfg.load_unverified else ""))
            self._move_aside([s for s in steps if s > step], step)
        return step

    def _load(self, steps: list[int]) -> int:
        if self.cfg.load_step:
            if self.cfg.load_step not in steps:
                raise ConfigError(f"checkpoint.load_step = {self.cfg.load_step} not found in "
                                  f"{self.folder}: available steps are "
                                  f"{', '.join(map(str, steps)) or 'none'}")
            step = self.cfg.load_step
        elif steps:
            step = steps[-1]
        else:
            return 0
        path = self.folder / f"step-{step:07d}"
        fix = ("It is damaged or was saved for another model shape or data source; point "
               "checkpoint.folder elsewhere or set checkpoint.load_step to another step")
        state = self._state(0)
        check_keys(state, path, f"checkpoint {path}", fix)
        if not self.cfg.load_unverified:
            verify_hashes(path, f"checkpoint {path}")
        check_data_settings(path, self.data_settings, self.cfg.reset_data_position)
        # Generator states are per rank: restored only when this rank's state was saved (the
        # same world size); otherwise the run keeps its seeded generators.
        saved = _saved_keys(path)
        extra = restorable_extra(state, saved, self.model)
        saved_rng = f"train.rng.rank{self.rank}" in saved
        if not saved_rng:
            del state["train"]["rng"]
        del state["train"]["data_settings"]  # read and compared above
        if self.cfg.reset_data_position:
            del state["train"][f"data_{self.data_key}"]
        else:
            self._check_streams(path, saved)
        read_checkpoint(state, path, f"checkpoint {path}", fix, verify=False)
        set_model_state_dict(self.model, with_extra(state, extra))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["train"]["scheduler"])
        if not self.cfg.reset_data_position:
            self.loader.load_state_dict(state["train"][f"data_{self.data_key}"])
        if saved_rng:
            set_rng_state(state["train"]["rng"][f"rank{self.rank}"])
        return int(state["train"]["step"])

    def _check_streams(self, path: Path, saved: set[str]) -> None:
        """Rank-local data states: one per data-parallel rank of the saving run, the same
        number on every rank, so that all refuse together."""
        streams = {k.split(".")[1] for k in saved if k.startswith("train.data_dp")}
        if self.data_key != "global" and streams and len(streams) != self.loader.dp_size:
            raise ConfigError(
                f"checkpoint {path}: its streamed data state was saved by {len(streams)} "
                f"data-parallel ranks and this run has {self.loader.dp_size}: streamed HF data "
                "resumes only under the same data-parallel degree; run with that degree, or "
                "use data.source = 'indexed' (which resumes under any)")

    def _move_aside(self, later: list[int], step: int) -> None:
        """The checkpoints after the resumed ``step`` (a branch the user left) moved into a
        folder of their own: kept, but no longer resumed from nor rotated."""
        if not later:
            return
        aside = self.folder / f"after-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._barrier()  # every rank has read the checkpoint
        if self.rank == 0:
            aside.mkdir()
            for s in later:
                (self.folder / f"step-{s:07d}").rename(aside / f"step-{s:07d}")
        self._barrier()
        logger.warning(f"checkpoint.load_step = {step}: the later checkpoints (step "
                       f"{', '.join(map(str, later))}) moved to {aside}; this run continues "
                       f"from step {step}")


def check_data_settings(path: Path, settings: dict[str, str], reset: bool) -> None:
    """Refuses a resume whose data ``settings`` differ from those saved in the checkpoint at
    ``path``: its data position would index other windows. ``reset``
    (``checkpoint.reset_data_position``) starts the data from its beginning instead, in one
    line."""
    saved_text = {"train": {"data_settings": ""}}
    if "train.data_settings" not in _saved_keys(path):
        logger.warning(f"checkpoint {path} has no record of its data settings (written by "
                       "an older dtrain): the data position is resumed unchecked")
        return
    read_checkpoint(saved_text, path, f"checkpoint {path}", "", verify=False)
    saved = json.loads(saved_text["train"]["data_settings"])
    changed = [k for k in sorted(set(saved) | set(settings))
               if saved.get(k) != settings.get(k)]
    if not changed:
        return
    if reset:
        logger.info(f"checkpoint.reset_data_position: the data starts from its beginning "
                    f"({', '.join(changed)} changed since the checkpoint)")
        return
    listed = "; ".join(f"{k} was {saved.get(k)!r} and is now {settings.get(k)!r}"
                       for k in changed)
    raise ConfigError(f"checkpoint {path}: the data settings changed since it was saved "
                      f"({listed}), so its saved data position would index other data: "
                      "set them back, or set checkpoint.reset_data_position = true to "
                      "start the data from its beginning")


def _saved_keys(path: Path) -> set[str]:
    """The flattened keys a checkpoint holds (empty when its metadata cannot be read: the load
    that follows then reports the problem)."""
    try:
        return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception:
        return set()


def load_model_weights(parts: list[nn.Module], path: str | Path) -> None:
    """Fills the model (any layout) with the weights of a checkpoint's ``model`` entry (an
    imported HF model, or a training checkpoint whose optimizer state is left out)."""
    model = whole_model_view(parts)
    state = model_state(model)
    extra = restorable_extra(state, _saved_keys(Path(path)), model)
    read_checkpoint(state, path, *_initial_weights_names(path))
    set_model_state_dict(model, with_extra(state, extra))


def check_initial_weights(path: str | Path) -> None:
    """What loading ``checkpoint.initial_weights`` reads first, its ``.metadata`` (the keys and
    the files' hashes are compared when it loads); the load's ConfigError when it is missing."""
    checkpoint_keys(Path(path), *_initial_weights_names(path))


def _initial_weights_names(path: str | Path) -> tuple[str, str]:
    """(what, fix) of the initial weights' errors."""
    return (f"checkpoint.initial_weights = {str(path)!r}",
            "Give a checkpoint of this model's shape (made by python -m dtrain.convert_hf import "
            "or by a dtrain run)")


def read_checkpoint(state: dict[str, Any], path: str | Path, what: str, fix: str,
                    verify: bool = True) -> None:
    """``dcp.load`` into ``state``, after comparing the model's keys and (``verify``) the files'
    hashes; any failure (a damaged or missing shard, a tensor the checkpoint lacks or has in
    another shape) becomes one ConfigError naming ``what`` and the root cause, then ``fix``."""
    if verify:
        check_keys(state, Path(path), what, fix)
        verify_hashes(Path(path), what)
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # DCP raises many types, some BaseException
        raise ConfigError(f"{what} cannot be loaded: {_first_line(e)}. {fix}") from None


@contextlib.contextmanager
def _quiet():
    """DCP warns at every call in a process without a process group that it assumes one
    process: true, and not the user's concern."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _root(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def _first_line(error: BaseException) -> str:
    """The root cause in one line."""
    error = _root(error)
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def _step_of(folder: Path) -> int:
    """The step of a checkpoint folder, written or being written (``step-0000100[.tmp]``)."""
    return int(folder.name.removeprefix("step-").removesuffix(".tmp"))
