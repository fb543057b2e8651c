"""The learning-rate schedule: warm-up, then cosine, linear, constant or warmup-stable-decay, to
``min_lr`` at ``decay_steps`` (``training.steps`` unless set) and at ``min_lr`` after.

The schedule's settings travel in its checkpointed state; a resume under other settings is
refused (``lr_schedule.override_checkpoint`` takes the new ones), as Megatron-LM refuses a
changed ``--lr-decay-iters`` or ``--min-lr``: a run resumed with more ``training.steps`` would
otherwise stretch its decay, and the learning rate would climb back from the floor it reached.
"""

from __future__ import annotations

import json
import math

import torch

from dtrain.config import ConfigError, LRScheduleConfig
from dtrain.log import logger


def decay_end(cfg: LRScheduleConfig, total_steps: int) -> int:
    """The step at which the decay reaches ``min_lr``."""
    return cfg.decay_steps or total_steps


def lr_factor(step: int, cfg: LRScheduleConfig, total_steps: int, peak_lr: float) -> float:
    """Multiplier of the peak learning rate for 1-based optimizer step ``step``.

    Warmup: step / warmup_steps. Then, over the steps after warmup, cosine or linear decay to
    min_lr at the decay's end (``decay_end``), constant, or wsd (warmup-stable-decay: constant,
    then decay over the last ``wsd_decay_fraction`` of the schedule's steps). After the decay's
    end: min_lr (a warm-up longer than the decay's span included)."""
    floor = cfg.min_lr / peak_lr
    end = decay_end(cfg, total_steps)
    if cfg.decay != "constant" and step > end:
        return floor
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        decay_start = max(end - round(cfg.wsd_decay_fraction * end), cfg.warmup_steps)
        if step <= decay_start or end <= decay_start:
            return 1.0 if step <= end else floor
        progress = min((step - decay_start) / (end - decay_start), 1.0)
        shape = {"linear": 1 - progress,
                 "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
                 "sqrt": 1 - math.sqrt(progress)}[cfg.wsd_decay_shape]
        return floor + (1 - floor) * shape
    span = end - cfg.warmup_steps
    progress = min((step - cfg.warmup_steps) / span, 1.0) if span > 0 else 1.0
    if cfg.decay == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def check_lr_schedule(cfg: LRScheduleConfig, peak_lr: float) -> None:
    """Refuses a floor above the peak (the "decay" would climb to it): ``min_lr`` is absolute,
    as Megatron-LM's ``--min-lr``, so a lower ``optimizer.lr`` needs a lower ``min_lr`` too."""
    if cfg.decay != "constant" and cfg.min_lr > peak_lr:
        raise ConfigError(
            f"lr_schedule.min_lr = {cfg.min_lr:g} is above optimizer.lr = {peak_lr:g}: the "
            f"{cfg.decay} decay would climb from the peak to it; set lr_schedule.min_lr at or "
            f"below optimizer.lr (e.g. --lr_schedule.min_lr {peak_lr / 10:g}, a tenth of it)")


def describe_lr_schedule(cfg: LRScheduleConfig, peak_lr: float, total_steps: int) -> str:
    """The schedule in words for the start-up line: peak, floor, warm-up, shape, the decay's end
    when it is not the last step; and a warning when the warm-up covers the whole run (the peak
    is never reached)."""
    floor = "" if cfg.decay == "constant" else f" to {cfg.min_lr:g}"
    end = decay_end(cfg, total_steps)
    if cfg.decay != "constant" and end != total_steps:
        floor += f" at step {end}"
    text = (f"lr {peak_lr:g}{floor} ({cfg.decay}), {cfg.warmup_steps} warm-up step"
            f"{'s' * (cfg.warmup_steps != 1)}")
    if cfg.warmup_steps >= total_steps:
        text += (f" (the warm-up covers all {total_steps} steps: the learning rate never reaches "
                 "its peak; lower lr_schedule.warmup_steps)")
    return text


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The schedule as a ``LambdaLR`` whose ``last_epoch`` counts optimizer steps; the lr in use
    at step s (1-based) is ``peak_lr * lr_factor(s)``. Its state carries its settings
    (``settings()``), checked on load."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: LRScheduleConfig,
                 total_steps: int, peak_lr: float):
        self.cfg, self.total_steps, self.peak_lr = cfg, total_steps, peak_lr
        # LambdaLR evaluates the factor at 0 on construction and at n after the n-th step, so
        # shift by one: the n-th optimizer step runs with factor(n).
        super().__init__(optimizer, lambda n: lr_factor(n + 1, self.cfg, self.total_steps,
                                                         self.peak_lr))

    def describe(self) -> str:
        """The schedule in words for the start-up line (``describe_lr_schedule``)."""
        return describe_lr_schedule(self.cfg, self.peak_lr, self.total_steps)

    def settings(self) -> dict[str, str | float | int]:
        """What the learning rate of each step depends on."""
        c = self.cfg
        out = {"lr": self.peak_lr, "warmup_steps": c.warmup_steps, "decay": c.decay}
        if c.decay != "constant":
            out |= {"min_lr": c.min_lr, "decay_end": decay_end(c, self.total_steps)}
        if c.decay == "wsd":
            out |= {"wsd_decay_fraction": c.wsd_decay_fraction,
                    "wsd_decay_shape": c.wsd_decay_shape}
        return out

    def extend(self, steps: int) -> None:
        """``steps`` more steps after the last one, trained at the schedule's final learning
        rate: the decay keeps its end (pinned in ``lr_schedule.decay_steps``)."""
        self.cfg.decay_steps = decay_end(self.cfg, self.total_steps)
        self.total_steps += steps

    def uncount_step(self) -> None:
        """An optimizer step whose update was skipped (a non-finite step, ``dtrain.nonfinite``)
        is taken back from the count: the schedule advances with the updates that happened, as
        Megatron-LM's does. The host learns of a skip when it reads the step's flag: at once
        on the CPU; one step late on a GPU (read without waiting for the device), so there the
        step after a skipped one still runs at the rate one step ahead, and the next ones at
        the count of updates."""
        self.last_epoch -= 1
        factor = self.lr_lambdas[0](self.last_epoch)
        self._last_lr = [base * factor for base in self.base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr

    def state_dict(self) -> dict:
        state = {k: v for k, v in super().state_dict().items()
                 if k not in ("cfg", "total_steps", "peak_lr")}
        state["settings"] = json.dumps(self.settings(), sort_keys=True)
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        saved = json.loads(state.pop("settings", "{}"))
        current = self.settings()
        changed = [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
        base_lrs = list(self.base_lrs)
        super().load_state_dict(state)
        if not saved or not changed:
            return
        listed = "; ".join(f"{k} was {saved.get(k)!r} and is now {current.get(k)!r}"
                           for k in changed)
        if not self.cfg.override_checkpoint:
            fix = (f" (to train past the end of the decay at its floor, keep its end: "
                   f"--lr_schedule.decay_steps {saved['decay_end']})"
                   if "decay_end" in changed and "decay_end" in saved else "")
            raise ConfigError(
                f"the checkpoint's learning-rate schedule differs from this run's ({listed}): "
                "the learning rate of the steps resumed would not be the schedule's it began"
                f"{fix}; set the settings back, or set lr_schedule.override_checkpoint = true "
                "to continue under the new schedule from the step resumed")
        logger.info(f"lr_schedule.override_checkpoint: the schedule continues under this run's "
                    f"settings ({listed})")
        self.base_lrs = base_lrs  # the new peak, not the saved one
        factor = self.lr_lambdas[0](self.last_epoch)  # the next step's, under the new settings
        self._last_lr = [base * factor for base in base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr
