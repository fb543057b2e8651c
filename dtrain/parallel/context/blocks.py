"""What every context-parallel algorithm shares: the rank's place in the cp group (``Shards``),
the layouts between (batch, seq, heads, head_dim) and (batch, heads, seq, head_dim), and one block
of attention with its log-sum-exp (forward, backward, merge) by kernel: cuDNN, flash or an exact
math path."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

_aten = torch.ops.aten


class Shards:
    """This rank's place in the cp group: chunk orders, index tensors, ring neighbours."""

    def __init__(self, group_name: str):
        self.group = _resolve_process_group(group_name)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        n = self.size
        # Chunk order of the concatenated shards (rank 0's two chunks, rank 1's, ...).
        self.rank_order = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
        self.natural_order = sorted(range(2 * n), key=self.rank_order.__getitem__)
        # Global ranks of the next and the previous rank of the ring.
        self.peers = tuple(dist.get_global_rank(self.group, (self.rank + step) % n)
                           for step in (1, -1))
        self._indices: dict[tuple, torch.Tensor] = {}

    def reorder(self, x: torch.Tensor, order: list[int], dim: int = 2) -> torch.Tensor:
        """Permutes the 2 cp chunks of sequence dimension ``dim`` of x into ``order``."""
        key = (tuple(order), x.device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(order, device=x.device)
        chunks = x.unflatten(dim, (2 * self.size, -1))
        return chunks.index_select(dim, self._indices[key]).flatten(dim, dim + 1)


_BY_GROUP: dict[str, Shards] = {}


def shards_of(group_name: str) -> Shards:
    if group_name not in _BY_GROUP:
        _BY_GROUP[group_name] = Shards(group_name)
    return _BY_GROUP[group_name]


def heads_first(*tensors: torch.Tensor):
    """(batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim) views."""
    return tuple(t.transpose(1, 2) for t in tensors)


def seq_first(t: torch.Tensor, owned: bool = False) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> contiguous (batch, seq, heads, head_dim): the layout every
    operator below returns (its fake implementation promises these strides to the compiler).
    Always new memory (an operator's outputs may not alias each other or its inputs) unless
    ``owned``: t is a buffer of its own."""
    out = t.transpose(1, 2)
    if not out.is_contiguous():
        return out.contiguous()
    return out if owned else out.clone()


def like_seq_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (batch, heads, seq, head_dim) tensor shaped as ``x`` whose memory is laid out as
    (batch, seq, heads, head_dim), so ``seq_first`` of it is free."""
    b, h, s, d = x.shape
    return x.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)


_EXTRAS: dict[tuple, tuple] = {}  # per (kernel, device): the kernel's placeholders for backward


def attend(q, k, v, causal: bool, kernel: str):
    """Attention of one block, (batch, heads, seq, head_dim) in: (out, log-sum-exp of the scores
    per query, fp32 (batch, heads, seq)). Causal only on square blocks. k, v may have fewer
    heads (grouped-query attention)."""
    b, hq, sq, d = q.shape
    if kernel == "cudnn":  # both kernels take grouped-query K/V as they are
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = \
            _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
        _EXTRAS.setdefault((kernel, q.device), (cum_q, cum_k, seed, offset, lse.dim()))
        return out, lse.reshape(b, hq, sq)
    if kernel == "flash":
        out, lse, cum_q, cum_k, _, _, rng, unused, _ = \
            _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        _EXTRAS.setdefault((kernel, q.device), (cum_q, cum_k, rng, unused))
        return out, lse
    hk, dtype = k.shape[1], math_dtype(q)
    scores = (q.to(dtype).reshape(b, hk, hq // hk, sq, d)
              @ k.to(dtype).unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(_upper(sq, k.shape[2], q.device), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def attend_backward(dout, q, k, v, out, lse, causal: bool, kernel: str):
    """Gradients (dq, dk, dv) of one block given the merged output and log-sum-exp."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if kernel == "cudnn":
        cum_q, cum_k, seed, offset, lse_dims = _EXTRAS[(kernel, q.device)]
        lse = lse.contiguous().view(b, hq, sq, *[1] * (lse_dims - 3))
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, sq, sk, 0.0, causal)
    if kernel == "flash":
        cum_q, cum_k, rng, unused = _EXTRAS[(kernel, q.device)]
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, sq, sk, 0.0, causal, rng, unused)
    group, dtype = (b, hk, hq // hk, sq, d), math_dtype(q)
    qf, dof = q.to(dtype).reshape(group), dout.to(dtype).reshape(group)
    kf, vf = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    scale = 1 / math.sqrt(d)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(sq, sk, q.device), float("-inf"))
    p = torch.exp(scores - lse.reshape(b, hk, hq // hk, sq, 1))
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * out.to(dtype).reshape(group)).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def math_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _upper(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def merge_eager(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    """Folds a block's (out, lse) into the running (out, lse), in place, computing in fp32 (or
    wider) whatever ``out``'s dtype: a bf16 ``out`` is rounded once per merge."""
    new = torch.logaddexp(lse, block_lse)
    dtype = math_dtype(out)
    merged = (out.to(dtype) * torch.exp(lse - new).unsqueeze(-1)
              + block_out.to(dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    out.copy_(merged)
    lse.copy_(new)


# On CUDA the merge is one compiled kernel (read both outputs, write one) where eager runs six
# passes over the output; it runs inside the attention operators, which the model's compiled
# graph calls as opaque kernels.
merge_fused = torch.compile(merge_eager, dynamic=False)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    (merge_fused if out.is_cuda else merge_eager)(out, lse, block_out, block_lse)


def accumulators(q: torch.Tensor):
    """The running fp32 output (laid out sequence first) and log-sum-exp of the local queries."""
    b, h, s, _ = q.shape
    dtype = math_dtype(q)
    return (like_seq_first(q, dtype).zero_(), q.new_full((b, h, s), float("-inf"), dtype=dtype))
