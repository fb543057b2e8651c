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
    """(batch, heads_i, local seq, head_dim) each -> (batch, heads_i / cp, whole seq in natural
    order, head_dim): one all-to-all trades the sequence split for a head split."""
    n = shards.size
    heads = [t.shape[1] // n for t in tensors]
    x = torch.cat([t.unflatten(1, (n, -1)) for t in tensors], dim=2)  # (b, n, h', s, d)
    x = _all_to_all(x.transpose(0, 1), shards)  # dim 0: the source rank's sequence shard
    x = shards.reorder(x.permute(1, 2, 0, 3, 4).flatten(2, 3), shards.natural_order)
    return x.split(heads, dim=1)


def _to_sequence(tensors, shards: Shards):
    """The inverse of ``_to_heads``: back to this rank's tokens, every head."""
    n = shards.size
    heads = [t.shape[1] for t in tensors]
    x = shards.reorder(torch.cat(tensors, dim=1), shards.rank_order)  # (b, h', seq, d)
    x = _all_to_all(x.unflatten(2, (n, -1)).permute(2, 0, 1, 3, 4), shards)  # (n, b, h', s, d)
    x = x.transpose(0, 1)  # dim 1: the head group of the source rank
    return tuple(t.flatten(1, 2) for t in x.split(heads, dim=2))


@torch.library.custom_op("dtrain::cp_a2a_attention", mutates_args=())
def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, kernel: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """(out, and for the backward: the head-split q, k, v, output and log-sum-exp)."""
    shards = shards_of(group)
    qh, kh, vh = _to_heads(heads_first(q, k, v), shards)
    out_h, lse_h = attend(qh, kh, vh, True, kernel)
    (out,) = _to_sequence([out_h], shards)
    return (seq_first(out, owned=True), seq_first(qh), seq_first(kh), seq_first(vh),
            seq_first(out_h, owned=True), lse_h.contiguous())


@torch.library.custom_op("dtrain::cp_a2a_attention_backward", mutates_args=())
def a2a_attention_backward(dout: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor,
                            vh: torch.Tensor, out_h: torch.Tensor, lse_h: torch.Tensor,
                            group: str, kernel: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shards = shards_of(group)
    (dout_h,) = _to_heads(heads_first(dout), shards)
    grads = attend_backward(dout_h, *heads_first(qh, kh, vh, out_h), lse_h, True, kernel)
    return tuple(seq_first(g) for g in _to_sequence(grads, shards))
