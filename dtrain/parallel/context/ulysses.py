"""a2a (Ulysses): an all-to-all trades the sequence split for a head split, each rank runs full
causal attention on heads / cp heads, an all-to-all trades back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.context.blocks import (
    Shards,
    attend,
    attend_backward,
    heads_first,
    seq_first,
    shards_of,
)


def _all_to_all(x: torch.Tensor, shards: Shards) -> torch.Tensor:
    """Equal-split all-to-all over dim 0."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=shards.group)
    return out


def _to_heads(tensors, shards: Shards):
    """(batch, heads_i, local seq, width_i) each -> (batch, heads_i / cp, whole seq in natural
    order, width_i): one all-to-all trades the sequence split for a head split."""
    n = shards.size
    # (n, b x heads_i / cp x s x width_i) each: row j for rank j's head group.
    rows = [t.unflatten(1, (n, -1)).transpose(0, 1).reshape(n, -1) for t in tensors]
    x = _all_to_all(torch.cat(rows, dim=1), shards)  # row j: rank j's sequence shard
    out = []
    for t, part in zip(tensors, x.split([r.shape[1] for r in rows], dim=1), strict=True):
        b, h, s, d = t.shape
        part = part.reshape(n, b, h // n, s, d).permute(1, 2, 0, 3, 4).flatten(2, 3)
        out.append(shards.reorder(part, shards.natural_order))
    return out


def _to_sequence(tensors, shards: Shards):
    """The inverse of ``_to_heads``: back to this rank's tokens, every head."""
    n = shards.size
    # (n, b x heads_i x local seq x width_i) each: row j for rank j's tokens.
    rows = [shards.reorder(t, shards.rank_order).unflatten(2, (n, -1))
            .permute(2, 0, 1, 3, 4).reshape(n, -1) for t in tensors]
    x = _all_to_all(torch.cat(rows, dim=1), shards)  # row j: rank j's head group
    out = []
    for t, part in zip(tensors, x.split([r.shape[1] for r in rows], dim=1), strict=True):
        b, h, seq, d = t.shape
        out.append(part.reshape(n, b, h, seq // n, d).transpose(0, 1).flatten(1, 2))
    return out


@torch.library.custom_op("dtrain::cp_a2a_attention", mutates_args=())
def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, kernel: str,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """(out, and for the backward: the head-split q, k, v, output and log-sum-exp)."""
    shards = shards_of(group)
    qh, kh, vh = _to_heads(heads_first(q, k, v), shards)
    out_h, lse_h = attend(qh, kh, vh, True, kernel, scale)
    (out,) = _to_sequence([out_h], shards)
    return (seq_first(out, owned=True), seq_first(qh), seq_first(kh), seq_first(vh),
            seq_first(out_h, owned=True), lse_h.contiguous())


@torch.library.custom_op("dtrain::cp_a2a_attention_backward", mutates_args=())
def a2a_attention_backward(dout: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor,
                            vh: torch.Tensor, out_h: torch.Tensor, lse_h: torch.Tensor,
                            group: str, kernel: str, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shards = shards_of(group)
    (dout_h,) = _to_heads(heads_first(dout), shards)
    grads = attend_backward(dout_h, *heads_first(qh, kh, vh, out_h), lse_h, True, kernel,
                            scale)
    return tuple(seq_first(g) for g in _to_sequence(grads, shards))
