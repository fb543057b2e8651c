"""all_gather: K/V all-gathered (dK/dV reduce-scattered in backward), then each local chunk
attends to the keys before it, causal within the chunk."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.context.blocks import (
    Shards,
    accumulators,
    attend,
    attend_backward,
    heads_first,
    like_seq_first,
    math_dtype,
    merge,
    pack,
    seq_first,
    shards_of,
    unpack,
)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, shards: Shards):
    """(keys, values), each (batch, kv heads, whole seq in natural order, its width), from every
    rank's k, v."""
    mine = pack(k, v)
    gathered = mine.new_empty(shards.size * mine.numel())
    dist.all_gather_into_tensor(gathered, mine, group=shards.group)
    parts = gathered.view(shards.size, -1).split([k.numel(), v.numel()], dim=1)
    whole = []
    for part, shape in zip(parts, (k.shape, v.shape), strict=True):
        # (cp, b, h, s, d) -> (b, h, cp x s, d): the sequence in rank order.
        part = part.unflatten(1, shape).permute(1, 2, 0, 3, 4).flatten(2, 3)
        whole.append(shards.reorder(part, shards.natural_order))
    return whole


def _scatter_grads(grads, shards: Shards, dtype: torch.dtype):
    """The whole sequence's (dK, dV), each (batch, kv heads, seq in natural order, its width),
    summed over the ranks and cut to this rank's tokens: its (dK, dV), contiguous."""
    rows = []
    for grad in grads:
        # Rank order, then (cp, b, h, local seq, d): one row of each rank's tokens.
        grad = shards.reorder(grad, shards.rank_order).unflatten(2, (shards.size, -1))
        rows.append(grad.permute(2, 0, 1, 3, 4).to(dtype).reshape(shards.size, -1))
    send = torch.cat(rows, dim=1)
    mine = send.new_empty(send.shape[1])
    dist.reduce_scatter_tensor(mine, send.flatten(), group=shards.group)
    shapes = [(*g.shape[:2], g.shape[2] // shards.size, g.shape[3]) for g in grads]
    return unpack(mine, *shapes)


def _gathered_blocks(shards: Shards, chunk: int):
    """For each local chunk: (query slice, [(key slice, causal)]): its own chunk's keys (causal)
    and, unless it is the first chunk, every key before it."""
    for i, index in enumerate((shards.rank, 2 * shards.size - 1 - shards.rank)):
        blocks = [(slice(index * chunk, (index + 1) * chunk), True)]
        if index:
            blocks.append((slice(0, index * chunk), False))
        yield slice(i * chunk, (i + 1) * chunk), blocks


@torch.library.custom_op("dtrain::cp_all_gather_attention", mutates_args=())
def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str,
                          kernel: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    shards = shards_of(group)
    q, k, v = heads_first(q, k, v)
    keys, values = _gather_kv(k, v, shards)
    out, lse = accumulators(q, v)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            block_out, block_lse = attend(q[:, :, qs], keys[:, :, ks], values[:, :, ks],
                                           causal, kernel, scale)
            merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
    return seq_first(out.to(q.dtype), owned=True), lse


@torch.library.custom_op("dtrain::cp_all_gather_attention_backward", mutates_args=())
def all_gather_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   group: str, kernel: str, scale: float
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V gathered again (cheaper than keeping the whole sequence's), dK/dV of the whole
    sequence reduce-scattered back to their owners."""
    shards = shards_of(group)
    dout, q, k, v, out = heads_first(dout, q, k, v, out)
    keys, values = _gather_kv(k, v, shards)
    dq = like_seq_first(q, math_dtype(q)).zero_()
    dk = torch.zeros(keys.shape, dtype=math_dtype(q), device=q.device)
    dv = torch.zeros(values.shape, dtype=math_dtype(q), device=q.device)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            dq_block, dk_block, dv_block = attend_backward(
                dout[:, :, qs], q[:, :, qs], keys[:, :, ks], values[:, :, ks], out[:, :, qs],
                lse[:, :, qs], causal, kernel, scale)
            dq[:, :, qs] += dq_block
            dk[:, :, ks] += dk_block
            dv[:, :, ks] += dv_block
    dk, dv = _scatter_grads((dk, dv), shards, k.dtype)
    return seq_first(dq.to(q.dtype), owned=True), seq_first(dk), seq_first(dv)
