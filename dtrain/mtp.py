"""Multi-token prediction's loss: the training side of ``dtrain.models.mtp``.

DeepSeek-V3's objective (report eq. 24-25): with ``D`` depths, depth k's loss is
``L_k = (1 / T) sum_i CE(P_k[i], t_{i+k+1})`` over the T tokens the next-token loss averages
(positions whose target lies past the sequence add nothing), and the training objective is
``L_main + (weight / D) sum_k L_k``. Megatron-Core divides each depth by its own count of valid
targets instead; the two differ by T / (T - k) per sequence, 1.0002 at T = 4096, k = 1.

``MTPLoss`` wraps the run's token loss: the value it returns, and the training loss logged, stay
the next-token loss; the depths' losses reach the gradient through ``WithGradientOf`` (the
scaled sum of the main loss's gradient) and the log through the step hook it also is
(``mtp_loss``: the mean over the depths of ``L_k``). Under a pipeline it runs on the last stage,
which holds the depths (``dtrain.parallel.pipeline``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dtrain.dtensor import full
from dtrain.hooks import StepHook

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class WithGradientOf(torch.autograd.Function):
    """``main`` unchanged; backward also gives ``extra`` the gradient ``weight`` times
    ``main``'s, so the optimised loss is ``main + weight * extra`` while the value is
    ``main``'s."""

    @staticmethod
    def forward(ctx, main: torch.Tensor, extra: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad * ctx.weight, None


class MTPLoss(StepHook):
    """The run's loss function with ``depths`` MTP depths: ``(logits, labels)`` with logits
    (batch x (1 + depths), seq, vocab) and labels (batch, seq, 1 + depths) -> the summed
    next-token loss of the first ``batch`` rows, with ``weight / depths`` times each depth's
    summed loss in its gradient. Logits and labels of the model alone (an evaluation batch)
    give the plain loss. ``tokens``: the tokens of a step, over all ranks (T of the module
    docstring, per step); ``groups``: the ranks whose losses add up to the step's (the data
    ranks and the pipeline stages)."""

    def __init__(self, loss_fn: LossFn, depths: int, weight: float, tokens: int,
                 groups: list[dist.ProcessGroup], device: torch.device):
        self.loss_fn, self.depths, self.weight = loss_fn, depths, weight
        self.tokens, self.groups, self.device = tokens, groups, device
        self.sums: torch.Tensor | None = None  # each depth's summed loss since the step began

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels.dim() == 2:
            return self.loss_fn(logits, labels)
        batch = labels.shape[0]
        main = self.loss_fn(logits[:batch], labels[..., 0])
        if logits.shape[0] == batch:  # the model without its depths
            return main
        losses = [self.loss_fn(logits[k * batch:(k + 1) * batch], labels[..., k])
                  for k in range(1, self.depths + 1)]
        with torch.no_grad():
            sums = torch.stack([full(loss.detach()).float() for loss in losses])
            self.sums = sums if self.sums is None else self.sums + sums
        return WithGradientOf.apply(main, sum(losses), self.weight / self.depths)

    def reset_stats(self) -> None:
        """Forgets the losses recorded since the step began."""
        self.sums = None

    def before_step(self) -> None:
        self.reset_stats()

    def abandon_step(self) -> None:
        self.reset_stats()

    def depth_losses(self) -> torch.Tensor:
        """Each depth's ``L_k`` of the last step, over all ranks (a collective)."""
        sums = self.sums.clone() if self.sums is not None \
            else torch.zeros(self.depths, device=self.device)
        for group in self.groups:
            dist.all_reduce(sums, group=group)
        return sums / self.tokens

    def record(self, step: int) -> dict[str, float]:
        losses = self.depth_losses().cpu()
        record = {"mtp_loss": losses.mean().item()}
        if self.depths > 1:
            record |= {f"mtp/depth{k + 1}_loss": losses[k].item() for k in range(self.depths)}
        return record

    def describe(self) -> str:
        return (f"multi-token prediction: {self.depths} depth{'s' if self.depths > 1 else ''}, "
                f"loss weight {self.weight} (their mean loss logged as mtp_loss)")


def with_mtp(loss_fn: LossFn, depths: int, weight: float, tokens: int,
             groups: list[dist.ProcessGroup], device: torch.device) -> LossFn:
    """``loss_fn`` for a model with ``depths`` MTP depths (``MTPLoss``), or as it is without."""
    return MTPLoss(loss_fn, depths, weight, tokens, groups, device) if depths else loss_fn
