"""Held-out loss during training: the same batches every ``validation.interval`` steps."""

from __future__ import annotations

import torch

from dtrain.config import ValidationConfig
from dtrain.dtensor import full
from dtrain.metrics import MetricsLogger
from dtrain.step import DeviceBatches


class Validator:
    """Evaluates the mean token loss over ``cfg.steps`` micro-batches of ``batches`` (rewound to
    their first batch every time) every ``cfg.interval`` steps and at the last of
    ``total_steps`` (``should_run``), logs it and keeps it in ``history``. ``reduce_sum`` sums
    over the ranks that hold different data; ``tokens`` is the number of tokens evaluated over
    all of them. Without validation (``cfg.enabled`` false) it never runs."""

    def __init__(self, cfg: ValidationConfig, batches: DeviceBatches | None, model, loss_fn,
                 context, reduce_sum, tokens: int, total_steps: int, logger: MetricsLogger):
        self.cfg, self.batches, self.model, self.loss_fn = cfg, batches, model, loss_fn
        self.context, self.reduce_sum, self.tokens = context, reduce_sum, tokens
        self.total_steps, self.logger = total_steps, logger
        self.start = batches.loader.state_dict() if batches is not None else None
        self.history: list[dict[str, float]] = []

    def describe(self) -> str | None:
        """The start-up summary's line (None without validation)."""
        if not self.cfg.enabled:
            return None
        return f"validation: every {self.cfg.interval} steps, {self.cfg.steps} batches"

    def should_run(self, step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.interval == 0 or step == self.total_steps)

    def run(self, step: int) -> float:
        loss = self.evaluate()
        self.history.append({"step": step, "val_loss": loss})
        self.logger.log_validation(step, loss)
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the validation batches (the same ones at every call)."""
        self.batches.loader.load_state_dict(self.start)
        self.model.eval()  # validation runs without pipeline parallel (refused by validate)
        total = torch.zeros((), device=self.batches.device)
        for _ in range(self.cfg.steps):
            inputs, labels = self.batches.next()
            with self.context():
                total += full(self.loss_fn(self.model(inputs), labels))
        self.model.train()
        return (self.reduce_sum(total) / self.tokens).item()
