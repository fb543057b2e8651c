"""What every context-parallel algorithm shares: the rank's place in the cp group (``Shards``),
the layouts between (batch, seq, heads, width) and (batch, heads, seq, width), K and V packed
into one message, and one block of attention with its log-sum-exp (forward, backward, merge) by
kernel: cuDNN, flash or an exact math path. Queries and keys share a width, values (and the
output) may have another (MLA's), and the softmax scale is each attention's own."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from dtrain.kernels.lazy_compile import compile_on_first_call

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


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One flat buffer of the tensors' elements in turn, each in its (batch, heads, seq, width)
    order: K and V, whose widths may differ, travel as one message."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(buffer: torch.Tensor, *shapes: torch.Size) -> tuple[torch.Tensor, ...]:
    """The inverse of ``pack``: contiguous views of ``buffer`` shaped as ``shapes``."""
    sizes = [math.prod(shape) for shape in shapes]
    return tuple(part.view(shape) for part, shape in zip(buffer.split(sizes), shapes,
                                                        strict=True))


def _kernel_widths(kernel: str, qk_width: int, v_width: int) -> tuple[int, int]:
    """The (query/key, value) head widths a fused kernel runs at: flash takes one width for q, k
    and v, a multiple of 8; cuDNN a multiple of 8 each, the two free to differ (DeepSeek-V3's
    192 and 128). Zero channels appended to q and k add nothing to the scores (the softmax scale
    is passed, never derived from the width) and those appended to v give output channels that
    are cut off, so the padded kernel computes the unpadded attention exactly."""
    def multiple_of_8(width: int) -> int:
        return -(-width // 8) * 8
    if kernel == "flash":
        width = multiple_of_8(max(qk_width, v_width))
        return width, width
    return multiple_of_8(qk_width), multiple_of_8(v_width)


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, heads, seq, width): ``t`` with zero channels appended, laid out sequence first
    as the unpadded inputs are."""
    if t.shape[-1] == width:
        return t
    return F.pad(t.transpose(1, 2), (0, width - t.shape[-1])).transpose(1, 2)


def attend(q, k, v, causal: bool, kernel: str, scale: float):
    """Attention of one block, (batch, heads, seq, width) in: (out, log-sum-exp of the scaled
    scores per query, fp32 (batch, heads, seq)). q and k have one width, v (and out) another;
    ``scale`` multiplies q k^T. Causal only on square blocks. k, v may have fewer heads
    (grouped-query attention)."""
    b, hq, sq, d = q.shape
    width = v.shape[-1]
    if kernel in ("cudnn", "flash"):  # both kernels take grouped-query K/V as they are
        qk_width, v_width = _kernel_widths(kernel, d, width)
        q, k, v = _padded(q, qk_width), _padded(k, qk_width), _padded(v, v_width)
    if kernel == "cudnn":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)
        _EXTRAS.setdefault((kernel, q.device), (cum_q, cum_k, seed, offset, lse.dim()))
        return out[..., :width], lse.reshape(b, hq, sq)
    if kernel == "flash":
        out, lse, cum_q, cum_k, _, _, rng, unused, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale)
        _EXTRAS.setdefault((kernel, q.device), (cum_q, cum_k, rng, unused))
        return out[..., :width], lse
    hk, dtype = k.shape[1], math_dtype(q)
    scores = (q.to(dtype).reshape(b, hk, hq // hk, sq, d)
              @ k.to(dtype).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(sq, k.shape[2], q.device), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, width).to(q.dtype), lse.reshape(b, hq, sq)


def attend_backward(dout, q, k, v, out, lse, causal: bool, kernel: str, scale: float):
    """Gradients (dq, dk, dv) of one block given the merged output and log-sum-exp."""
    if kernel in ("cudnn", "flash"):
        qk_width, v_width = _kernel_widths(kernel, q.shape[-1], v.shape[-1])
        grads = _fused_backward(*(_padded(t, w) for t, w in (
            (dout, v_width), (q, qk_width), (k, qk_width), (v, v_width), (out, v_width))),
            lse, causal, kernel, scale)
        return tuple(g[..., :t.shape[-1]] for g, t in zip(grads, (q, k, v), strict=True))
    b, hq, sq, d = q.shape
    hk, sk, width = k.shape[1], k.shape[2], v.shape[-1]
    dtype = math_dtype(q)
    qf = q.to(dtype).reshape(b, hk, hq // hk, sq, d)
    dof = dout.to(dtype).reshape(b, hk, hq // hk, sq, width)
    kf, vf = k.to(dtype).unsqueeze(2), v.to(dtype).unsqueeze(2)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_upper(sq, sk, q.device), float("-inf"))
    p = torch.exp(scores - lse.reshape(b, hk, hq // hk, sq, 1))
    dv = (p.transpose(-1, -2) @ dof).sum(2)
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * out.to(dtype).reshape(dof.shape)).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf).sum(2) * scale
    return dq.reshape(b, hq, sq, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fused_backward(dout, q, k, v, out, lse, causal: bool, kernel: str, scale: float):
    """The cuDNN or flash backward of one block, inputs already at the kernel's widths."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    if kernel == "cudnn":
        cum_q, cum_k, seed, offset, lse_dims = _EXTRAS[(kernel, q.device)]
        lse = lse.contiguous().view(b, hq, sq, *[1] * (lse_dims - 3))
        return _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, sq, sk, 0.0, causal,
            scale=scale)
    cum_q, cum_k, rng, unused = _EXTRAS[(kernel, q.device)]
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, sq, sk, 0.0, causal, rng, unused,
        scale=scale)


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
merge_fused = compile_on_first_call(merge_eager, dynamic=False)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    (merge_fused if out.is_cuda else merge_eager)(out, lse, block_out, block_lse)


def accumulators(q: torch.Tensor, v: torch.Tensor):
    """The running fp32 output (v's width, laid out sequence first) and log-sum-exp of the local
    queries."""
    b, h, s, _ = q.shape
    dtype = math_dtype(q)
    out = q.new_zeros((b, s, h, v.shape[-1]), dtype=dtype).transpose(1, 2)
    return out, q.new_full((b, h, s), float("-inf"), dtype=dtype)
