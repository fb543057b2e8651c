"""Mixture-of-experts feed-forward (Mixtral, DeepSeek style), single-device code: expert parallel
is applied from outside (``dtrain.parallel.expert``) around the ``experts`` module.

A token's hidden state goes to ``top_k`` of ``n_experts`` SwiGLU experts chosen by a router:

- ``softmax`` (Mixtral): probabilities over the experts, the top k taken and renormalised to sum
  to one. ``sigmoid`` (DeepSeek-V3): independent scores; the top k of score + ``expert_bias`` are
  taken (the bias only steers the choice, aux-loss-free balancing) and their scores normalised;
  optionally within the best groups of experts only, and scaled (DeepSeek-V3's group-limited
  routing and ``routed_scaling_factor``, ``Router``).
- Load-balancing loss (Switch/Megatron, ``aux_loss``): ``E * sum_e f_e * P_e``, with ``f_e`` the
  share of the k x T assignments that chose expert e and ``P_e`` the mean router score of e over
  the T tokens (1.0 when perfectly balanced). ``seq_aux_loss`` (DeepSeek-V3's complementary
  sequence-wise loss, report eq. 17-20): the same over each sequence's tokens, ``f_e`` counting
  the top k of the plain scores (no bias, no groups), averaged over the sequences as Megatron
  does. Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)^2``. All are computed
  per forward (a micro-batch on one rank) and enter the gradient through ``AuxLoss``: the forward
  output is unchanged, backward adds ``coeff * grad_scale`` times their gradients, so the
  training loss reported stays the plain LM loss.
- Dropless by default; with ``capacity_factor > 0`` each expert takes at most
  ``ceil(capacity_factor * T * k / E)`` assignments, the earlier tokens first, and the rest are
  dropped (they contribute nothing from that expert; the residual stream carries them on).
- Experts are three ``[n_experts, ...]`` parameters (``w1``, ``w3``: ``[E, hidden, dim]``,
  ``w2``: ``[E, dim, hidden]``), computed on tokens sorted by expert with one grouped GEMM per
  matrix (``dtrain.models.grouped_gemm``: ``torch._grouped_mm``, fast in bf16 on CUDA sm90+;
  FP8 with ``fp8.experts``) or a loop over experts elsewhere. They compute in the compute dtype
  (autocast's under autocast): the routed tokens and each stacked weight are cast whole, and
  each weight's gradient is one stacked tensor from the grouped GEMM's backward (no per-expert
  ``select`` in autograd, no host sync). The weights' operands come from one seam,
  ``GroupedExperts.weight_operands``: cast in each forward here; a variant overrides it (the
  training's weights cast once per optimizer step, ``dtrain.step_weights.experts``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.dtensor import local
from dtrain.kernels.accumulate import stage_ends
from dtrain.models.feed_forward import FeedForward
from dtrain.models.grouped_gemm import (
    cast_weight,
    group_rows,
    grouped_linear,
    pad_groups,
    step_cast_weight,
    unpad_groups,
)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` has a fast kernel for ``x``: bf16 on CUDA sm90 or newer."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls of ``x`` run in: autocast's where autocast is on, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor, mode: str = "plain",
                   operands: list | None = None, fp8_grad: bool = False) -> torch.Tensor:
    """SwiGLU of each expert on its rows of ``x`` (rows sorted by expert, ``counts[e]`` rows for
    expert e) with grouped GEMMs (``grouped_gemm.GroupedLinear``): no host sync. ``mode``:
    ``plain`` (``x``'s dtype; rows past ``counts.sum()`` unspecified in the output), or ``fp8`` /
    ``fp8_emulated`` / ``blockwise`` / ``blockwise_emulated`` on groups padded to multiples of
    16 (128 for blockwise) rows on the device (``grouped_gemm.pad_groups``; rows past
    ``counts.sum()`` zero). ``operands``: each weight's cast operands and the gradient its
    backward adds into (``GroupedExperts.weight_operands``), else each weight cast here;
    ``fp8_grad``: FP8 modes add the weight gradients into those in FP8
    (``grouped_gemm.fp8_weight_gradient``)."""
    if mode == "plain":
        rows, ends = x, torch.cumsum(counts, 0, dtype=torch.int32)
    else:
        rows, ends, dest = pad_groups(x, counts, group_rows(mode))
    ends = stage_ends(ends)  # the weight gradients read them on the host: copied there now
    op1, op2, op3 = operands or (None, None, None)
    h = (F.silu(grouped_linear(rows, w1, ends, mode, op1, fp8_grad))
         * grouped_linear(rows, w3, ends, mode, op3, fp8_grad))
    out = grouped_linear(h, w2, ends, mode, op2, fp8_grad)
    return out if mode == "plain" else unpad_groups(out, dest, counts)


def looped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """The same as ``grouped_swiglu`` with one matmul per expert (any device and dtype; one host
    sync to read the counts). Rows past ``counts.sum()`` are zero."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        outs.append((F.silu(rows @ w1[e].t()) * (rows @ w3[e].t())) @ w2[e].t())
        start += n
    out = torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])
    return F.pad(out, (0, 0, 0, x.shape[0] - start))


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU feed-forwards stored as ``[n_experts, ...]`` parameters. Input: tokens
    sorted by expert and the count per expert; output: each token's expert output, same order,
    in ``x``'s dtype (the compute dtype; FP8 experts: bf16)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, gemm: str = "auto"):
        super().__init__()
        self.gemm = gemm  # auto (grouped where fast), grouped, loop
        # "fp8", "fp8_emulated", "blockwise" or "blockwise_emulated" for FP8 grouped GEMMs (set by
        # dtrain.parallel.fp8)
        self.fp8: str | None = None
        # fp8.experts_weight_gradient: FP8 weight gradients where added into .grad in place
        self.fp8_weight_gradient = False
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether the forward on ``x`` runs grouped GEMMs (FP8, or the grouped GEMM)."""
        return self.fp8 is not None or self.gemm == "grouped" or (
            self.gemm == "auto" and grouped_mm_available(x))

    def cast_weights(self, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
        """The operands of ``w1``, ``w2``, ``w3`` for the grouped GEMMs in ``dtype`` (or FP8),
        cast outside autograd by one compiled kernel each on the GPU."""
        return [step_cast_weight(local(w), self.fp8 or "plain", dtype)
                for w in (self.w1, self.w2, self.w3)]

    def weight_operands(self, dtype: torch.dtype
                        ) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]:
        """The seam of the grouped GEMMs: for ``w1``, ``w2``, ``w3``, the operands in ``dtype``
        (or FP8) and the fp32 gradient their backward adds into in place (None: the gradient
        goes to the weight through autograd). Here each forward casts its own; a variant
        overrides this (the weights cast once per step, ``dtrain.step_weights.experts``)."""
        mode = self.fp8 or "plain"
        return [(cast_weight(local(w), mode, dtype), None) for w in (self.w1, self.w2, self.w3)]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        if self.grouped(x):
            return grouped_swiglu(x, counts, w1, w2, w3, self.fp8 or "plain",
                                  self.weight_operands(x.dtype), self.fp8_weight_gradient)
        # Whole stacked casts (fp32 weights under autocast): their backward is one cast of the
        # stacked gradient, where autocast would cast each expert's slice inside the loop.
        return looped_swiglu(x, counts, *(w.to(x.dtype) for w in (w1, w2, w3)))


class Router(nn.Module):
    """Scores each token against every expert and picks ``top_k``.

    ``n_group`` > 1 (sigmoid routers; DeepSeek-V3's group-limited routing): the experts form
    ``n_group`` equal groups, each scored by the sum of its two highest biased scores, and the
    top k is taken among the experts of the ``topk_group`` best groups. The chosen weights,
    normalised or not, are multiplied by ``routed_scale`` (DeepSeek-V3's
    ``routed_scaling_factor``)."""

    def __init__(self, dim: int, n_experts: int, top_k: int, score: str = "softmax",
                 norm_topk: bool = True, n_group: int = 1, topk_group: int = 1,
                 routed_scale: float = 1.0):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {score!r}: use softmax or sigmoid")
        per_group = n_experts // max(n_group, 1)
        if n_group > 1 and (score != "sigmoid" or n_experts % n_group or per_group < 2
                            or not 1 <= topk_group <= n_group or top_k > topk_group * per_group):
            raise ValueError(f"group-limited routing needs a sigmoid router, n_group = {n_group} "
                             f"groups of 2 or more of the {n_experts} experts, and top_k = "
                             f"{top_k} within the experts of topk_group = {topk_group} groups")
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk
        self.n_group, self.topk_group, self.routed_scale = n_group, topk_group, routed_scale
        self.gate = nn.Linear(dim, n_experts, bias=False)
        if score == "sigmoid":  # aux-loss-free balancing: steers the choice, not the weights
            self.register_buffer("expert_bias", torch.zeros(n_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (tokens, dim) -> (logits, scores) (tokens, experts) in fp32, the chosen experts
        (tokens, top_k) and their weights (tokens, top_k)."""
        logits = self.gate(x).float()
        if self.score == "softmax":
            scores = logits.softmax(dim=-1)
            chosen = scores.topk(self.top_k, dim=-1).indices
        else:
            scores = logits.sigmoid()
            biased = scores.detach() + self.expert_bias
            if self.n_group > 1:
                biased = self.in_best_groups(biased)
            chosen = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.norm_topk or self.score == "sigmoid":
            # + 1e-20 as transformers' DeepSeek-V3: a sum above 1e-12 stays as it is in fp32.
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return logits, scores, chosen, weights

    def in_best_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """``biased`` (tokens, experts) with -inf outside each token's ``topk_group`` groups of
        highest score, a group's score being the sum of its two highest."""
        groups = biased.unflatten(-1, (self.n_group, -1))
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
        return groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(-2)


def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int,
                        shards: int = 1) -> torch.Tensor:
    """Switch/Megatron auxiliary loss ``E * sum_e f_e P_e``: ``f_e = counts[e] / (T k)`` (counts
    of assignments before any drop), ``P_e`` the mean over tokens of ``scores[:, e]`` (scores
    normalised per token for sigmoid routers). 1.0 when perfectly balanced. ``scores`` (T, E)
    with ``counts`` (E,); or (S, T, E) with (S, E): the loss of each of S sets of T tokens (the
    sequences, ``seq_aux_loss``), averaged.

    With the tokens split into ``shards`` equal parts (sequence parallel), ``scores`` are this
    shard's and ``counts`` the sum over all shards: the mean of the shards' results is the loss
    of the whole set of tokens."""
    tokens, n_experts = scores.shape[-2:]
    probs = scores / scores.sum(dim=-1, keepdim=True)
    f = counts.to(probs.dtype) / (tokens * shards * top_k)
    return n_experts * (f * probs.mean(-2)).sum(-1).mean()


def sequence_counts(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per sequence, the tokens whose ``top_k`` highest ``scores`` include each expert:
    scores (sequences, tokens, experts) -> (sequences, experts) int64. DeepSeek-V3's
    ``1(s_it in Topk(s_jt, K))``: the plain scores of all experts, whatever bias or group
    limit chose the token's experts."""
    top = scores.topk(top_k, dim=-1).indices.flatten(1)
    counts = torch.zeros(scores.shape[0], scores.shape[-1], dtype=torch.int64,
                         device=scores.device)
    return counts.scatter_add_(1, top, torch.ones_like(top))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2 (keeps router logits small)."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class AuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also sends gradient ``scale`` into ``loss``, so the loss is
    optimised without being added to the reported training loss (works through pipeline
    stages and activation checkpointing alike)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """The MoE feed-forward of one block: router, ``experts`` (a ``GroupedExperts``) and an
    optional shared expert that every token goes through. A training ``forward`` (grad enabled)
    keeps statistics in buffers for logging: tokens routed to each expert and the sums of the aux
    and z losses (``stats()`` reads them, ``reset_stats()`` clears them)."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, score: str = "softmax",
                 norm_topk: bool = True, shared_hidden: int = 0, capacity_factor: float = 0.0,
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, gemm: str = "auto",
                 aux_grad_scale: float = 1.0, n_group: int = 1, topk_group: int = 1,
                 routed_scale: float = 1.0, aux_loss_type: str = "aux_loss"):
        super().__init__()
        self.aux_loss_type = aux_loss_type
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        # Gradient of the aux losses per forward: 1 / the micro-batches whose losses are
        # averaged, as the LM loss is scaled (divided again by the sequence shards, below).
        self.aux_grad_scale = aux_grad_scale
        # Set from outside (dtrain.parallel) when a micro-batch's tokens are split over several
        # ranks (sequence or context parallel): expert counts (of the forward, or of each
        # sequence) -> (their sum over those ranks, the number of ranks); the aux loss then uses
        # the summed counts.
        self.sum_over_shards: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None
        self.router = Router(dim, n_experts, top_k, score, norm_topk, n_group, topk_group,
                             routed_scale)
        self.experts = GroupedExperts(dim, hidden, n_experts, gemm)
        self.shared_expert = FeedForward(dim, shared_hidden) if shared_hidden else None
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts), persistent=False)
        self.register_buffer("loss_sums", torch.zeros(3), persistent=False)  # aux, z, forwards

    def capacity(self, tokens: int) -> int:
        """Assignments one expert takes from ``tokens`` tokens (capacity factor > 0)."""
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, k = x.shape[0], self.top_k
        logits, scores, chosen, weights = self.router(x)
        expert = chosen.flatten()  # assignment i = token i // k, its (i % k)-th choice
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, expert, torch.ones_like(expert))
        aux, shards = self.balance_loss(scores, counts, shape[-2])  # x: (..., seq, dim)
        z = router_z_loss(logits)
        if torch.is_grad_enabled():  # training forwards only (not evaluation or shape probes)
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
                # A shard is that fraction of a forward: sums over the shards give the
                # micro-batch's figures.
                self.loss_sums += torch.stack([aux.detach(), z.detach(),
                                               aux.new_ones(())]) / shards
        order = torch.argsort(expert, stable=True)
        if self.capacity_factor > 0:  # drop assignments past each expert's capacity
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.empty_like(order)
            rank_in_expert[order] = torch.arange(order.numel(), device=x.device) - starts[
                expert[order]]
            kept = rank_in_expert < self.capacity(tokens)
            counts = counts.clamp(max=self.capacity(tokens))
            order = torch.argsort(torch.where(kept, expert, self.n_experts), stable=True)
            kept_sorted = kept[order]
        token = order // k
        # Gathered, then cast: the backward sums each token's k gradients in x's dtype.
        out = self.experts(x[token].to(compute_dtype(x)), counts)
        gate = weights.flatten()[order].unsqueeze(1)
        if self.capacity_factor > 0:  # dropped rows (last) hold no expert output
            out = torch.where(kept_sorted.unsqueeze(1), out, 0.0)
        combined = torch.zeros_like(x).index_add_(0, token, (out * gate).to(x.dtype))
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(x)
        if torch.is_grad_enabled() and (self.aux_loss_coeff or self.z_loss_coeff):
            loss = self.aux_loss_coeff * aux + self.z_loss_coeff * z
            # A sequence shard's losses are that share of the micro-batch's.
            combined = AuxLoss.apply(combined, loss, self.aux_grad_scale / shards)
        return combined.view(shape)

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor,
                     seq_len: int) -> tuple[torch.Tensor, int]:
        """The load-balancing loss of this forward's router ``scores`` (tokens, experts), its
        tokens sequences of ``seq_len`` one after the other, and ``counts`` (experts,), the
        assignments chosen; and the number of sequence shards (``sum_over_shards``) it is one
        of. ``aux_loss``: over all the tokens, from ``counts``; ``seq_aux_loss``: over each
        sequence, from its ``sequence_counts``, averaged."""
        if self.aux_loss_type == "seq_aux_loss":
            scores = scores.view(-1, seq_len, self.n_experts)
            counts = sequence_counts(scores, self.top_k)
        shards = 1
        if self.sum_over_shards is not None:
            counts, shards = self.sum_over_shards(counts)
        return load_balancing_loss(scores, counts, self.top_k, shards), shards

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.loss_sums.zero_()

    def stats(self) -> torch.Tensor:
        """[tokens per expert..., aux loss sum, z-loss sum, forwards] since the last reset."""
        return torch.cat([self.tokens_per_expert, self.loss_sums])

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Aux-loss-free balancing (sigmoid routers): raise the bias of experts that got fewer
        than the mean number of tokens (``tokens_per_expert``, over all data), lower the rest."""
        load = tokens_per_expert.to(self.router.expert_bias)
        self.router.expert_bias += rate * torch.sign(load.mean() - load)
