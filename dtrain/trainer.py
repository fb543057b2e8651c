"""The training loop: ``Trainer(load_config("debug")).train()``.

Each step: the step hooks' ``before_step`` -> the forward and backward of the global batch
(gradient accumulation or a pipeline schedule) -> the global gradient norm and clipping -> the
non-finite check (``dtrain.nonfinite``: such a step's update changes nothing) ->
``before_update`` -> the weight update -> ``after_update`` -> the LR schedule -> ``after_step``.
A step that raises before its update (an interrupt, a caught out-of-memory error) leaves no
gradient and no hook state behind (``StepHook.abandon_step``).
Around the steps, the checkpointer says when to save, the validator when to evaluate and the
metrics when to log; each owns its timing and its figures. A preemption signal ends the run at a
step boundary with a checkpoint (``dtrain.preemption``); the hang watchdog hears from every step
(``dtrain.watchdog``). Everything the loop calls is built by ``dtrain.run.Run``.
"""

from __future__ import annotations

import contextlib
import gc

import torch

from dtrain.checkpoint import checkpoint_steps
from dtrain.config import ConfigError
from dtrain.errors import CheckpointNotSaved, Preempted
from dtrain.log import Progress, logger
from dtrain.optim import clip_grad_norm_, skip_update_if
from dtrain.preemption import note_preemption
from dtrain.run import Run
from dtrain.step import StepResult


class Trainer(Run):
    """A run that trains: ``train()`` to the last step (again after ``train(until=...)``),
    ``run_step()`` for one step as the loop takes it, ``train_step()`` for one step waited for."""

    def run_step(self) -> StepResult:
        """One optimizer step over the global batch, as the training loop runs it: the returned
        figures are device tensors nothing has waited for, and with the overlapped step
        (``optimizer.overlap_step``) the weight updates may still be running on their side
        stream. The next step's forward waits for them unit by unit; anything else reading the
        weights calls ``wait_for_update()`` first.

        A step that raises before its update (Ctrl-C between micro-batches, a caught
        out-of-memory error) is abandoned (``_abandon_step``) and the exception goes on as it
        was: the weights, the optimizer and the step count are those of the last step. The
        micro-batches it took are not given back: the next step takes the ones after them."""
        lr = self.optimizer.param_groups[0]["lr"]
        params = [p for part in self.model_parts for p in part.parameters()]
        pp_mesh = self.dims.mesh("pp")
        try:
            self.hooks.before_step()
            loss_sum = self.forward_backward(self.batches)
            grad_norm = clip_grad_norm_(params, self.config.training.max_norm,
                                        pp_mesh.get_group() if pp_mesh else None, self.optimizer)
            flag = self.nonfinite.flag(loss_sum, grad_norm)
            self.hooks.before_update()
        except BaseException:
            self._abandon_step()
            raise
        self.nonfinite.note(self.step + 1, flag)  # noted once the step is sure to be taken
        if skip_update_if(self.optimizer, flag):
            self.update.step()
        self.hooks.after_update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.hooks.after_step(self.step)
        return StepResult(loss_sum, grad_norm, lr, self.batches.take_wait())

    def _abandon_step(self) -> None:
        """Drops what a step that raised before its update left: the step hooks' copies and
        state for it (``StepHook.abandon_step``), every gradient (set to None: the next
        step's backwards do not add onto a part of this one's) and its data wait."""
        self.hooks.abandon_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.batches.take_wait()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``run_step`` with its updates complete: (mean token loss over the global batch,
        gradient norm, seconds spent waiting for data)."""
        result = self.run_step()
        self.wait_for_update()
        return self.mean_loss(result.loss_sum), result.grad_norm, result.data_wait

    def wait_for_update(self) -> None:
        """The device's compute stream waits for the last step's weight updates."""
        self.update.wait()

    def extend(self, steps: int) -> None:
        """``steps`` more optimizer steps after ``training.steps``, for the next ``train()``.
        The schedule keeps its meaning: its decay still ends where it did (pinned in
        ``lr_schedule.decay_steps``) and the steps added train at its final learning rate
        (``min_lr``; the peak for ``constant``). The last step's checkpoint and validation move
        to the new last step; config.toml records the new length, and a resume from the
        command line gives the same two settings (``--training.steps``,
        ``--lr_schedule.decay_steps``)."""
        if steps < 1:
            raise ConfigError(f"extend({steps}): give a number of steps >= 1")
        self.scheduler.extend(steps)
        self.config.training.steps += steps
        for part in (self.checkpointer, self.validator, self.metrics):
            if part is not None:
                part.total_steps = self.config.training.steps
        self.write_config()
        last, sched = self.config.training.steps, self.scheduler
        final_lr = sched.peak_lr if sched.cfg.decay == "constant" else sched.cfg.min_lr
        end = "" if sched.cfg.decay == "constant" else \
            f" (its decay ends at step {sched.cfg.decay_steps})"
        logger.info(f"extended to {last} steps: steps {last - steps + 1}-{last} train at lr "
                    f"{final_lr:g}, the schedule's end{end}")

    def evaluate(self) -> float:
        """Mean token loss over the validation batches (the same ones at every call)."""
        if self.validator.batches is None:
            raise ConfigError("evaluate(): this run has no held-out data: build the trainer with "
                              "validation.enabled = true and validation.path (or the indexed "
                              "source's valid split)")
        self.wait_for_update()
        return self.validator.evaluate()

    def train(self, until: int | None = None) -> list[dict[str, float]]:
        """Runs to ``training.steps`` (or stops after step ``until``: the schedule still spans
        ``training.steps``; a later ``train()`` goes on from there); returns this call's logged
        records (every call's are in ``history`` and metrics.jsonl). A call with nothing left
        to train, or an ``until`` past the last step, says so in one line."""
        steps = self.config.training.steps
        last = min(until or steps, steps)
        if until is not None and until > steps:
            logger.warning(f"train(until={until}): the run ends at training.steps = {steps}; "
                           f"it stops there (trainer.extend({until - steps}) adds the steps "
                           "after it, at the schedule's final learning rate)")
        if self.step >= last:
            logger.warning(f"train(): nothing to train: the run is at step {self.step} "
                           + (f"of {steps}, its last (trainer.extend(n) adds n more)"
                              if self.step >= steps else f"already, past until={until}"))
            return []
        first_record = len(self.history)
        self.metrics.start(self.step, last)
        self.watchdog.start(self.step)
        self.preemption.arm()
        progress = Progress(self.rank, self.step, last)
        try:
            with manual_gc(self.config.training.gc_interval) as collect:
                while self.step < last:
                    result = self.run_step()
                    collect(self.step)
                    self.watchdog.beat(self.step)
                    # The step's record before its checkpoint: a run killed during the save
                    # resumes after an earlier step and logs this one again, never loses it.
                    if self.metrics.step_done(self.step, result.data_wait):
                        self.history.append(self.metrics.log(self.step, result,
                                                             self.hooks.record(self.step)))
                    if self.checkpointer and self.checkpointer.should_save(self.step):
                        with self.metrics.paused(), self.watchdog.phase("checkpoint save"):
                            self.wait_for_update()
                            self.checkpointer.save(self.step)
                    if self.validator.should_run(self.step):
                        with self.metrics.paused(), self.watchdog.phase("validation"):
                            self.wait_for_update()
                            self.validator.run(self.step)
                    self.watchdog.beat(self.step)
                    progress.update()
                    self.preemption.stop_if_interrupted()
                    if signal := self.preemption.requested():
                        self._stop_for(signal)
            self.nonfinite.settle()  # a last step's flag, read before the run counts as done
        finally:
            progress.close()
            self.preemption.disarm()
            self.watchdog.stop()
            self.wait_for_update()  # the weights are the last step's for whatever reads them
            self._pause()
        if self.step == self.config.training.steps:
            self._check_final_checkpoint()
            if self.rank == 0:  # it lists rank 0's folder
                logger.info(self.metrics.done_line(self.step, self.history, self.run_dir))
        return self.history[first_record:]

    def _check_final_checkpoint(self) -> None:
        """A run that reached its last step without that step's checkpoint (the disk filled,
        or became read-only) ends with ``CheckpointNotSaved``, never as a success."""
        ckpt = self.checkpointer
        if ckpt is None or ckpt.saved_step == self.step:
            return
        latest = checkpoint_steps(ckpt.folder)
        raise CheckpointNotSaved(
            f"the run reached its last step {self.step} but its checkpoint could not be saved "
            f"({ckpt.not_saved}); "
            + (f"the latest checkpoint is step {latest[-1]}" if latest else "no checkpoint "
               "was saved") + f": make room in {ckpt.folder} and run the same command again to "
            f"train the steps since (exit code {CheckpointNotSaved.exit_code})")

    def _stop_for(self, signal: str) -> None:
        """A preemption signal reached a rank: every rank saves the current step (unless it was
        saved already) and stops."""
        saved = "checkpointing is off: nothing saved"
        if self.checkpointer:
            self.wait_for_update()
            with self.watchdog.phase("checkpoint save"):
                if self.checkpointer.saved_step != self.step:
                    self.checkpointer.save(self.step)
                self.checkpointer.close()  # an asynchronous save completes before the exit
            if self.checkpointer.saved_step == self.step:
                saved = f"checkpoint step {self.step} saved in {self.checkpointer.folder}"
            else:
                saved = f"the checkpoint of step {self.step} could not be saved"
        message = (f"{signal}: stopped after step {self.step}; {saved}; exit code "
                   f"{Preempted.exit_code} (run the same command again to resume)")
        logger.info(message)
        if self.rank == 0:
            note_preemption(self.run_dir, self.step, signal)
        raise Preempted(message)

    def _pause(self) -> None:
        """Between ``train()`` calls: a save in flight completed, the prefetching stopped (the
        loader rewound to the last batch used) and the metrics files closed; each starts again
        when the next ``train()`` needs it."""
        if self.checkpointer:
            self.checkpointer.close()
        self.loader.close()
        self.metrics_logger.close()


@contextlib.contextmanager
def manual_gc(interval: int):
    """Python's automatic garbage collection off for the block, and a function of the step that
    collects the young generations every ``interval`` steps; the collector's state is restored
    after (notebooks go on with it). ``interval`` 0: nothing changes."""
    if interval <= 0:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.collect(1)  # the young generations (a full collection walks the whole heap)
    gc.disable()
    try:
        yield lambda step: gc.collect(1) if step % interval == 0 else None
    finally:
        if was_enabled:
            gc.enable()
