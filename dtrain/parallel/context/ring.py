"""p2p: ring attention. K/V travel around the cp ring, each step's transfer overlapped with the
attention of the block already held; partial results are merged by their log-sum-exp. Backward
sends K/V around again with the dK/dV accumulated so far, which arrive at their owner."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtrain.parallel.context.blocks import (
    Shards,
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


def _exchange(send: torch.Tensor, shards: Shards):
    """Starts sending ``send`` to the next rank of the ring and receiving the previous rank's
    into a new buffer; returns (buffer, requests)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, shards.peers[0], shards.group),
           dist.P2POp(dist.irecv, recv, shards.peers[1], shards.group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _ring_block(r: int, src: int, half: int):
    """Which part of the block (local queries x K/V of rank ``src``) the causal mask keeps:
    (query slice, key slice, causal). Earlier ranks' first chunks are seen by all local queries;
    later ranks' chunks only by the local second chunk."""
    everything = slice(None)
    if src == r:
        return everything, everything, True
    if src < r:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


@torch.library.custom_op("dtrain::cp_ring_attention", mutates_args=())
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str,
                    kernel: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention, (batch, local seq, heads, width) in: (out of v's width, log-sum-exp)."""
    shards = shards_of(group)
    r, n = shards.rank, shards.size
    q, k, v = heads_first(q, k, v)
    half = q.shape[2] // 2
    shapes = (k.shape, v.shape)
    kv = pack(k, v)
    out = lse = None
    for step in range(n):
        if step + 1 < n:  # the next block travels while this one is computed
            incoming, requests = _exchange(kv, shards)
        qs, ks, causal = _ring_block(r, (r - step) % n, half)
        keys, values = unpack(kv, *shapes)
        block_out, block_lse = attend(q[:, :, qs], keys[:, :, ks], values[:, :, ks], causal,
                                       kernel, scale)
        if out is None:  # the rank's own block, all its queries: the running result as it is
            out, lse = block_out, block_lse
            if n > 2:  # several merges follow: accumulate in fp32, round once at the end
                out = like_seq_first(block_out, math_dtype(q)).copy_(block_out)
        else:
            merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        if step + 1 < n:
            _wait(requests)
            kv = incoming
    return seq_first(out.to(q.dtype), owned=True), lse


@torch.library.custom_op("dtrain::cp_ring_attention_backward", mutates_args=())
def ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, group: str,
                             kernel: str, scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V go around the ring again; each block's dK/dV travels with them, accumulating, and
    arrives at the rank that owns the block after the last step."""
    shards = shards_of(group)
    r, n = shards.rank, shards.size
    dout, q, k, v, out = heads_first(dout, q, k, v, out)
    half = q.shape[2] // 2
    # Gradients summed over two blocks (cp = 2) stay in the kernel's dtype: an in-place add
    # rounds the exact sum once, as an fp32 accumulator would at the end, and dK/dV travel in
    # half the bytes. More blocks accumulate in fp32.
    acc = q.dtype if n == 2 else math_dtype(q)
    shapes = (k.shape, v.shape)
    kv = pack(k, v)
    dq = dkv = pending = None
    for step in range(n):
        if step + 1 < n:
            incoming, requests = _exchange(kv, shards)
        qs, ks, causal = _ring_block(r, (r - step) % n, half)
        keys, values = unpack(kv, *shapes)
        dq_block, dk_block, dv_block = attend_backward(
            dout[:, :, qs], q[:, :, qs], keys[:, :, ks], values[:, :, ks], out[:, :, qs],
            lse[:, :, qs], causal, kernel, scale)
        if dq is None:  # the rank's own block: all its queries and keys
            dq = dq_block.to(acc)
            dkv = pack(dk_block.to(acc), dv_block.to(acc))
        else:
            dq[:, :, qs] += dq_block
            # The dK/dV accumulated by the ranks this block visited before arrives meanwhile.
            _wait(pending)
            dk, dv = unpack(dkv, *shapes)
            dk[:, :, ks] += dk_block
            dv[:, :, ks] += dv_block
        dkv, pending = _exchange(dkv, shards)
        if step + 1 < n:
            _wait(requests)
            kv = incoming
    _wait(pending)
    dk, dv = unpack(dkv, *shapes)
    return seq_first(dq.to(q.dtype), owned=True), seq_first(dk.to(k.dtype)), \
        seq_first(dv.to(v.dtype))
