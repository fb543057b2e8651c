"""Context parallel: the sequence split over the ``cp`` mesh, attention computed across the shards.

Load balancing: the sequence is cut into ``2 cp`` chunks and rank ``i`` holds chunks ``i`` and
``2 cp - 1 - i``, so under the causal mask every rank has the same amount of attention work. The
trainer gives each rank its two chunks (``load_balanced_positions``) and the model rotates them by
their true positions; everything but attention is per token and runs on the local tokens.

Attention across the shards (``parallel.cp_comm_type``, as Megatron's ``--cp-comm-type``):

- ``p2p``: ring attention. K/V travel around the ring, each step's transfer overlapped with the
  attention of the block already held; partial results are merged by their log-sum-exp. Backward
  sends K/V around again, with the dK/dV accumulated so far, which arrive at their owner.
- ``all_gather``: K/V all-gathered (reduce-scattered dK/dV in backward), then each local chunk
  attends to the keys before it, causal within the chunk.
- ``a2a``: Ulysses. An all-to-all trades the sequence split for a head split, each rank runs full
  causal attention on ``heads / cp`` heads, an all-to-all trades back.

Inputs of the attention are (batch, heads, local seq, head_dim), K/V with the model's (fewer)
KV heads: K/V are communicated before grouped-query expansion.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from dtrain.config import ConfigError
from dtrain.models.llama import Transformer, expand_kv

COMM_TYPES = ("p2p", "all_gather", "a2a")
_aten = torch.ops.aten


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (int64, length seq_len / cp) of the tokens context-parallel rank ``rank`` holds:
    chunk ``rank`` then chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def check_cp(model: Transformer, cp: int, tp: int, seq_len: int, comm_type: str) -> None:
    """Raises ConfigError when the sequence does not split into 2 cp (x tp) chunks, or, for
    ``a2a``, the (tensor-parallel local) heads do not split over cp."""
    if seq_len % (2 * cp * tp):
        what = f"2 x parallel.cp x parallel.tp = 2 x {cp} x {tp}" if tp > 1 \
            else f"2 x parallel.cp = 2 x {cp}"
        raise ConfigError(f"training.seq_len = {seq_len} is not divisible by {what} = "
                          f"{2 * cp * tp} (the sequence is cut into 2 chunks per context-parallel "
                          f"rank{', each split over tp' if tp > 1 else ''}): use a multiple of "
                          f"{2 * cp * tp}")
    if comm_type == "a2a":
        args = model.args
        for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
            local = value // tp
            if local % cp:
                per_rank = f" / tp = {local} per tensor-parallel rank" if tp > 1 else ""
                raise ConfigError(
                    f"parallel.cp_comm_type = 'a2a' splits the heads over parallel.cp = {cp}, "
                    f"but the model's {name} ({value}{per_rank}) is not divisible by {cp}: use "
                    "cp_comm_type 'p2p' or 'all_gather', or a cp that divides the heads")


def apply_cp(model: Transformer, cp_mesh: DeviceMesh, comm_type: str) -> None:
    """Replaces each block's core attention with context-parallel attention over ``cp_mesh``.
    The model must then be called with the rank's positions (``load_balanced_positions``)."""
    for block in model.layers.values():
        backends = block.attention.backends
        block.attention.core_attention = ContextParallelAttention(cp_mesh, comm_type, backends)


class ContextParallelAttention:
    """Causal attention of this rank's two chunks against the whole sequence."""

    def __init__(self, cp_mesh: DeviceMesh, comm_type: str, backends: list):
        if comm_type not in COMM_TYPES:
            raise ConfigError(f"parallel.cp_comm_type = {comm_type!r}: use one of "
                              f"{', '.join(COMM_TYPES)}")
        self.group = cp_mesh.get_group()
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self.comm_type = comm_type
        self.backends = backends
        # Chunk order of the concatenated shards (rank 0's two chunks, rank 1's, ...).
        self.rank_order = [c for r in range(self.size) for c in (r, 2 * self.size - 1 - r)]
        self.natural_order = sorted(range(2 * self.size), key=self.rank_order.__getitem__)
        self._indices: dict[tuple, torch.Tensor] = {}  # on the device, made once
        # Global ranks of the next and the previous rank of the ring.
        self.peers = tuple(dist.get_global_rank(self.group, (self.rank + step) % self.size)
                           for step in (1, -1))

    @torch.compiler.disable  # communication inside: runs eagerly between compiled regions
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (batch, local seq, heads, head_dim), k and v with the KV heads -> the attention
        output of the local queries, (batch, local seq, heads, head_dim)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.comm_type == "p2p":
            out = _RingAttention.apply(q, k, v, self.group, self.rank, self.size, self.peers)
        elif self.comm_type == "all_gather":
            out = self._all_gather(q, k, v)
        else:
            out = self._a2a(q, k, v)
        return out.transpose(1, 2)

    def _kernels(self, q: torch.Tensor):
        """The model's SDPA kernel choice (on CUDA)."""
        if q.is_cuda:
            return sdpa_kernel(self.backends, set_priority=True)
        return contextlib.nullcontext()

    def _reorder(self, x: torch.Tensor, order: list[int], dim: int = 2) -> torch.Tensor:
        """Permutes the 2 cp chunks of sequence dimension ``dim`` of x into ``order``."""
        key = (tuple(order), x.device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(order, device=x.device)
        index = self._indices[key]
        chunks = x.unflatten(dim, (2 * self.size, -1))
        return chunks.index_select(dim, index).flatten(dim, dim + 1)

    def _all_gather(self, q, k, v):
        kv = _AllGather.apply(torch.stack([k, v]), self.group)  # (cp, 2, b, h, 2c, d)
        kv = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # (2, b, h, seq in rank order, d)
        k, v = self._reorder(kv, self.natural_order, dim=3).unbind(0)
        fast = _fast_kernel(q)
        if not fast:
            k, v = _expand_heads(k, v, q.shape[1] // k.shape[1])
        chunk = q.shape[2] // 2
        outs = []
        for i, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            # Keys up to the end of this chunk; causal aligned to the last key (lower right).
            end = (index + 1) * chunk
            qi, ki, vi = q[:, :, i * chunk:(i + 1) * chunk], k[:, :, :end], v[:, :, :end]
            if fast:  # flash attention aligns its causal mask to the last key, takes GQA
                outs.append(_aten._scaled_dot_product_flash_attention(qi, ki, vi, 0.0, True)[0])
            else:
                outs.append(F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=causal_lower_right(chunk, end)))
        return torch.cat(outs, dim=2)

    def _a2a(self, q, k, v):
        n, hq, s, hk = self.size, q.shape[1], q.shape[2], k.shape[1]
        # One all-to-all for q, k and v: head group g of each goes to rank g.
        x = torch.cat([t.unflatten(1, (n, -1)) for t in (q, k, v)], dim=2)  # (b, n, h', s, d)
        x = _AllToAll.apply(x.transpose(0, 1).contiguous(), self.group)  # dim 0: source rank
        x = self._reorder(x.permute(1, 2, 0, 3, 4).flatten(2, 3), self.natural_order)
        q, k, v = x.split([hq // n, hk // n, hk // n], dim=1)
        k, v = _expand_heads(k, v, q.shape[1] // k.shape[1])
        with self._kernels(q):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self._reorder(out, self.rank_order).unflatten(2, (n, s))  # (b, h', n, s, d)
        out = _AllToAll.apply(out.permute(2, 0, 1, 3, 4).contiguous(), self.group)
        return out.transpose(0, 1).flatten(1, 2)  # (b, hq, s, d)


def _expand_heads(k: torch.Tensor, v: torch.Tensor, repeat: int):
    """The model's grouped-query expansion for (batch, heads, seq, head_dim) tensors."""
    k, v = expand_kv(k.transpose(1, 2), v.transpose(1, 2), repeat)
    return k.transpose(1, 2), v.transpose(1, 2)


class _AllGather(Function):
    """x -> (cp, *x.shape) stacked from every rank; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.unflatten(0, (n, -1))

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


class _AllToAll(Function):
    """Equal-split all-to-all over dim 0 (its own inverse, so also its backward)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _exchange(send: torch.Tensor, group, peers: tuple[int, int]):
    """Starts sending ``send`` to the next rank of the ring and receiving the previous rank's
    into a new buffer; returns (buffer, requests)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, peers[0], group),
           dist.P2POp(dist.irecv, recv, peers[1], group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _fast_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _attend(q, k, v, causal: bool):
    """Attention of one block: (out, log-sum-exp of the scores per query in fp32, what the
    backward kernel needs besides). Causal only on square blocks. GQA: k, v may have fewer
    heads."""
    if _fast_kernel(q):
        out, lse, cum_q, cum_k, _, _, rng, unused, _ = \
            _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, rng, unused)
    b, hq, sq, d = q.shape
    hk, dtype = k.shape[1], _math_dtype(q)
    scores = (q.to(dtype).reshape(b, hk, hq // hk, sq, d)
              @ k.to(dtype).unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(_upper(sq, k.shape[2], q.device), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq), None


def _attend_backward(dout, q, k, v, out, lse, causal: bool, extras):
    """Gradients (dq, dk, dv) of one block given the merged output and log-sum-exp."""
    if _fast_kernel(q):
        cum_q, cum_k, rng, unused = extras  # empty without variable lengths and dropout
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, rng,
            unused)
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group, dtype = (b, hk, hq // hk, sq, d), _math_dtype(q)
    qf, dof = q.to(dtype).reshape(group), dout.to(dtype).reshape(group)
    kf, vf = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    scale = 1 / math.sqrt(d)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(sq, sk, q.device), float("-inf"))
    p = torch.exp(scores - lse.view(b, hk, hq // hk, sq, 1))
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * out.to(dtype).reshape(group)).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    return dq.reshape(b, hq, sq, d), dk, dv


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _upper(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Folds a block's (out, lse) into the running fp32 (out, lse), in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


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


class _RingAttention(Function):
    @staticmethod
    def forward(ctx, q, k, v, group, r, n, peers):
        half = q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(n):
            if step + 1 < n:
                incoming, requests = _exchange(kv, group, peers)
            qs, ks, causal = _ring_block(r, (r - step) % n, half)
            block_out, block_lse, extras = _attend(q[:, :, qs], kv[0][:, :, ks],
                                                   kv[1][:, :, ks], causal)
            if out is None:
                ctx.extras = extras
                out, lse = block_out.to(_math_dtype(q)), block_lse.to(_math_dtype(q)).clone()
            else:
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if step + 1 < n:
                _wait(requests)
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.r, ctx.n, ctx.peers = group, r, n, peers
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, r, n, peers = ctx.group, ctx.r, ctx.n, ctx.peers
        half = q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=_math_dtype(q))
        kv = torch.stack([k, v])
        dkv, pending = None, None
        for step in range(n):
            if step + 1 < n:
                incoming, requests = _exchange(kv, group, peers)
            qs, ks, causal = _ring_block(r, (r - step) % n, half)
            grads = _attend_backward(dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks],
                                     kv[1][:, :, ks], out[:, :, qs],
                                     lse[:, :, qs].contiguous(), causal, ctx.extras)
            dq[:, :, qs] += grads[0]
            # The dK/dV accumulated by the ranks this block visited before arrives meanwhile.
            if pending is None:
                dkv = torch.zeros_like(kv, dtype=_math_dtype(q))
            else:
                _wait(pending)
            dkv[0][:, :, ks] += grads[1]
            dkv[1][:, :, ks] += grads[2]
            # Pass it on; after the last step it reaches the rank that owns the block.
            dkv, pending = _exchange(dkv, group, peers)
            if step + 1 < n:
                _wait(requests)
                kv = incoming
        _wait(pending)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None)
