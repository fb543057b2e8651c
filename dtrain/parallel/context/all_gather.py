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
    seq_first,
    shards_of,
)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, shards: Shards) -> torch.Tensor:
    """(2, batch, kv heads, whole seq in natural order, head_dim) from every rank's k, v."""
    kv = torch.stack([k, v])
    gathered = kv.new_empty((shards.size * 2, *kv.shape[1:]))
    dist.all_gather_into_tensor(gathered, kv, group=shards.group)
    # (cp, 2, b, h, s, d) -> (2, b, h, cp x s, d): the sequence in rank order.
    gathered = gathered.unflatten(0, (shards.size, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
    return shards.reorder(gathered, shards.natural_order, dim=3)


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
                          kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    shards = shards_of(group)
    q, k, v = heads_first(q, k, v)
    keys, values = _gather_kv(k, v, shards).unbind(0)
    out, lse = accumulators(q)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            block_out, block_lse = attend(q[:, :, qs], keys[:, :, ks], values[:, :, ks],
                                           causal, kernel)
            merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
    return seq_first(out.to(q.dtype), owned=True), lse


@torch.library.custom_op("dtrain::cp_all_gather_attention_backward", mutates_args=())
def all_gather_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   group: str, kernel: str
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V gathered again (cheaper than keeping the whole sequence's), dK/dV of the whole
    sequence reduce-scattered back to their owners."""
    shards = shards_of(group)
    dout, q, k, v, out = heads_first(dout, q, k, v, out)
    keys, values = _gather_kv(k, v, shards).unbind(0)
    dq = like_seq_first(q, math_dtype(q)).zero_()
    dkv = torch.zeros((2, *keys.shape), dtype=math_dtype(q), device=q.device)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            dq_block, dk_block, dv_block = attend_backward(
                dout[:, :, qs], q[:, :, qs], keys[:, :, ks], values[:, :, ks], out[:, :, qs],
                lse[:, :, qs], causal, kernel)
            dq[:, :, qs] += dq_block
            dkv[0][:, :, ks] += dk_block
            dkv[1][:, :, ks] += dv_block
    # Whole sequence in rank order -> (cp, 2, batch, kv heads, local seq, head_dim).
    dkv = shards.reorder(dkv, shards.rank_order, dim=3).unflatten(3, (shards.size, -1))
    dkv = dkv.permute(3, 0, 1, 2, 4, 5).to(k.dtype).contiguous()
    mine = dkv.new_empty(dkv.shape[1:])
    dist.reduce_scatter_tensor(mine, dkv.flatten(0, 1), group=shards.group)
    return seq_first(dq.to(q.dtype), owned=True), seq_first(mine[0]), seq_first(mine[1])
