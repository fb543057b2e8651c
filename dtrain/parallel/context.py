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

Inputs of the attention are (batch, local seq, heads, head_dim), K/V with the model's (fewer)
KV heads: K/V are communicated, and attended, without grouped-query expansion. Blocks are
computed by the cuDNN or flash kernel (the first of the two in the model's attention backends;
both return the log-sum-exp that merging blocks needs, and both take grouped K/V), on CPU or in
fp32 by an exact math path.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.nn.attention import SDPBackend

from dtrain.config import ConfigError
from dtrain.models.llama import Transformer

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
    """Causal attention of this rank's two chunks against the whole sequence.

    Each comm type is one custom operator (``torch.ops.dtrain.cp_*_attention``) with its backward
    another: ``torch.compile`` keeps the block in one graph around it, and selective activation
    checkpointing saves its outputs (``activation_checkpoint.SAVE_OPS``) so the recomputation in
    backward neither attends nor communicates again."""

    def __init__(self, cp_mesh: DeviceMesh, comm_type: str, backends: list):
        if comm_type not in COMM_TYPES:
            raise ConfigError(f"parallel.cp_comm_type = {comm_type!r}: use one of "
                              f"{', '.join(COMM_TYPES)}")
        self.group_name = cp_mesh.get_group().group_name
        self.comm_type = comm_type
        self.backends = backends

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (batch, local seq, heads, head_dim), k and v with the KV heads -> the attention
        output of the local queries, (batch, local seq, heads, head_dim)."""
        op = CP_OPS[self.comm_type]
        return op(q, k, v, self.group_name, _kernel(q, self.backends))[0]


def _kernel(q: torch.Tensor, backends: list) -> str:
    """The block kernel: the first of cuDNN and flash attention in the model's SDPA backends
    (both return the log-sum-exp that merging blocks needs), on CUDA in 16-bit; else "math"."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        for backend in backends:
            if backend == SDPBackend.CUDNN_ATTENTION:
                return "cudnn"
            if backend == SDPBackend.FLASH_ATTENTION:
                return "flash"
    return "math"


class _Shards:
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


_SHARDS: dict[str, _Shards] = {}


def _shards(group_name: str) -> _Shards:
    if group_name not in _SHARDS:
        _SHARDS[group_name] = _Shards(group_name)
    return _SHARDS[group_name]


def _heads_first(*tensors: torch.Tensor):
    """(batch, seq, heads, head_dim) -> (batch, heads, seq, head_dim) views."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _seq_first(t: torch.Tensor, owned: bool = False) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> contiguous (batch, seq, heads, head_dim): the layout every
    operator below returns (its fake implementation promises these strides to the compiler).
    Always new memory (an operator's outputs may not alias each other or its inputs) unless
    ``owned``: t is a buffer of its own."""
    out = t.transpose(1, 2)
    if not out.is_contiguous():
        return out.contiguous()
    return out if owned else out.clone()


def _like_seq_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty (batch, heads, seq, head_dim) tensor shaped as ``x`` whose memory is laid out as
    (batch, seq, heads, head_dim), so ``_seq_first`` of it is free."""
    b, h, s, d = x.shape
    return x.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)


# ---- one block of attention: (out, log-sum-exp) and its backward, by kernel --------------------

_EXTRAS: dict[tuple, tuple] = {}  # per (kernel, device): the kernel's placeholders for backward


def _attend(q, k, v, causal: bool, kernel: str):
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
    hk, dtype = k.shape[1], _math_dtype(q)
    scores = (q.to(dtype).reshape(b, hk, hq // hk, sq, d)
              @ k.to(dtype).unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(_upper(sq, k.shape[2], q.device), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.to(dtype).unsqueeze(2)
    return out.reshape(b, hq, sq, d).to(q.dtype), lse.reshape(b, hq, sq)


def _attend_backward(dout, q, k, v, out, lse, causal: bool, kernel: str):
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
    group, dtype = (b, hk, hq // hk, sq, d), _math_dtype(q)
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


def _math_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _upper(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _merge_eager(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> None:
    """Folds a block's (out, lse) into the running (out, lse), in place, computing in fp32 (or
    wider) whatever ``out``'s dtype: a bf16 ``out`` is rounded once per merge."""
    new = torch.logaddexp(lse, block_lse)
    dtype = _math_dtype(out)
    merged = (out.to(dtype) * torch.exp(lse - new).unsqueeze(-1)
              + block_out.to(dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    out.copy_(merged)
    lse.copy_(new)


# On CUDA the merge is one compiled kernel (read both outputs, write one) where eager runs six
# passes over the output; it runs inside the attention operators, which the model's compiled
# graph calls as opaque kernels.
_merge_fused = torch.compile(_merge_eager, dynamic=False)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    (_merge_fused if out.is_cuda else _merge_eager)(out, lse, block_out, block_lse)


def _accumulators(q: torch.Tensor):
    """The running fp32 output (laid out sequence first) and log-sum-exp of the local queries."""
    b, h, s, _ = q.shape
    dtype = _math_dtype(q)
    return (_like_seq_first(q, dtype).zero_(), q.new_full((b, h, s), float("-inf"), dtype=dtype))


# ---- p2p: ring attention ------------------------------------------------------------------------

def _exchange(send: torch.Tensor, shards: _Shards):
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
def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention, (batch, local seq, heads, head_dim) in: (out, log-sum-exp)."""
    shards = _shards(group)
    r, n = shards.rank, shards.size
    q, k, v = _heads_first(q, k, v)
    half = q.shape[2] // 2
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(n):
        if step + 1 < n:  # the next block travels while this one is computed
            incoming, requests = _exchange(kv, shards)
        qs, ks, causal = _ring_block(r, (r - step) % n, half)
        block_out, block_lse = _attend(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal,
                                       kernel)
        if out is None:  # the rank's own block, all its queries: the running result as it is
            out, lse = block_out, block_lse
            if n > 2:  # several merges follow: accumulate in fp32, round once at the end
                out = _like_seq_first(q, _math_dtype(q)).copy_(block_out)
        else:
            _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
        if step + 1 < n:
            _wait(requests)
            kv = incoming
    return _seq_first(out.to(q.dtype), owned=True), lse


@torch.library.custom_op("dtrain::cp_ring_attention_backward", mutates_args=())
def _ring_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, group: str,
                             kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V go around the ring again; each block's dK/dV travels with them, accumulating, and
    arrives at the rank that owns the block after the last step."""
    shards = _shards(group)
    r, n = shards.rank, shards.size
    dout, q, k, v, out = _heads_first(dout, q, k, v, out)
    half = q.shape[2] // 2
    # Gradients summed over two blocks (cp = 2) stay in the kernel's dtype: an in-place add
    # rounds the exact sum once, as an fp32 accumulator would at the end, and dK/dV travel in
    # half the bytes. More blocks accumulate in fp32.
    acc = q.dtype if n == 2 else _math_dtype(q)
    kv = torch.stack([k, v])
    dq = dkv = pending = None
    for step in range(n):
        if step + 1 < n:
            incoming, requests = _exchange(kv, shards)
        qs, ks, causal = _ring_block(r, (r - step) % n, half)
        dq_block, dk_block, dv_block = _attend_backward(
            dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
            lse[:, :, qs], causal, kernel)
        if dq is None:  # the rank's own block: all its queries and keys
            dq = dq_block.to(acc)
            dkv = torch.stack([dk_block, dv_block]).to(acc)
        else:
            dq[:, :, qs] += dq_block
            # The dK/dV accumulated by the ranks this block visited before arrives meanwhile.
            _wait(pending)
            dkv[0][:, :, ks] += dk_block
            dkv[1][:, :, ks] += dv_block
        dkv, pending = _exchange(dkv, shards)
        if step + 1 < n:
            _wait(requests)
            kv = incoming
    _wait(pending)
    return _seq_first(dq.to(q.dtype), owned=True), _seq_first(dkv[0].to(k.dtype)), \
        _seq_first(dkv[1].to(v.dtype))


# ---- all_gather: K/V gathered, reduce-scattered dK/dV -------------------------------------------

def _gather_kv(k: torch.Tensor, v: torch.Tensor, shards: _Shards) -> torch.Tensor:
    """(2, batch, kv heads, whole seq in natural order, head_dim) from every rank's k, v."""
    kv = torch.stack([k, v])
    gathered = kv.new_empty((shards.size * 2, *kv.shape[1:]))
    dist.all_gather_into_tensor(gathered, kv, group=shards.group)
    # (cp, 2, b, h, s, d) -> (2, b, h, cp x s, d): the sequence in rank order.
    gathered = gathered.unflatten(0, (shards.size, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
    return shards.reorder(gathered, shards.natural_order, dim=3)


def _gathered_blocks(shards: _Shards, chunk: int):
    """For each local chunk: (query slice, [(key slice, causal)]): its own chunk's keys (causal)
    and, unless it is the first chunk, every key before it."""
    for i, index in enumerate((shards.rank, 2 * shards.size - 1 - shards.rank)):
        blocks = [(slice(index * chunk, (index + 1) * chunk), True)]
        if index:
            blocks.append((slice(0, index * chunk), False))
        yield slice(i * chunk, (i + 1) * chunk), blocks


@torch.library.custom_op("dtrain::cp_all_gather_attention", mutates_args=())
def _all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str,
                          kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    shards = _shards(group)
    q, k, v = _heads_first(q, k, v)
    keys, values = _gather_kv(k, v, shards).unbind(0)
    out, lse = _accumulators(q)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            block_out, block_lse = _attend(q[:, :, qs], keys[:, :, ks], values[:, :, ks],
                                           causal, kernel)
            _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
    return _seq_first(out.to(q.dtype), owned=True), lse


@torch.library.custom_op("dtrain::cp_all_gather_attention_backward", mutates_args=())
def _all_gather_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                   group: str, kernel: str
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V gathered again (cheaper than keeping the whole sequence's), dK/dV of the whole
    sequence reduce-scattered back to their owners."""
    shards = _shards(group)
    dout, q, k, v, out = _heads_first(dout, q, k, v, out)
    keys, values = _gather_kv(k, v, shards).unbind(0)
    dq = _like_seq_first(q, _math_dtype(q)).zero_()
    dkv = torch.zeros((2, *keys.shape), dtype=_math_dtype(q), device=q.device)
    for qs, blocks in _gathered_blocks(shards, q.shape[2] // 2):
        for ks, causal in blocks:
            dq_block, dk_block, dv_block = _attend_backward(
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
    return _seq_first(dq.to(q.dtype), owned=True), _seq_first(mine[0]), _seq_first(mine[1])


# ---- a2a: Ulysses -------------------------------------------------------------------------------

def _all_to_all(x: torch.Tensor, shards: _Shards) -> torch.Tensor:
    """Equal-split all-to-all over dim 0."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=shards.group)
    return out


def _to_heads(tensors, shards: _Shards):
    """(batch, heads_i, local seq, head_dim) each -> (batch, heads_i / cp, whole seq in natural
    order, head_dim): one all-to-all trades the sequence split for a head split."""
    n = shards.size
    heads = [t.shape[1] // n for t in tensors]
    x = torch.cat([t.unflatten(1, (n, -1)) for t in tensors], dim=2)  # (b, n, h', s, d)
    x = _all_to_all(x.transpose(0, 1), shards)  # dim 0: the source rank's sequence shard
    x = shards.reorder(x.permute(1, 2, 0, 3, 4).flatten(2, 3), shards.natural_order)
    return x.split(heads, dim=1)


def _to_sequence(tensors, shards: _Shards):
    """The inverse of ``_to_heads``: back to this rank's tokens, every head."""
    n = shards.size
    heads = [t.shape[1] for t in tensors]
    x = shards.reorder(torch.cat(tensors, dim=1), shards.rank_order)  # (b, h', seq, d)
    x = _all_to_all(x.unflatten(2, (n, -1)).permute(2, 0, 1, 3, 4), shards)  # (n, b, h', s, d)
    x = x.transpose(0, 1)  # dim 1: the head group of the source rank
    return tuple(t.flatten(1, 2) for t in x.split(heads, dim=2))


@torch.library.custom_op("dtrain::cp_a2a_attention", mutates_args=())
def _a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: str, kernel: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """(out, and for the backward: the head-split q, k, v, output and log-sum-exp)."""
    shards = _shards(group)
    qh, kh, vh = _to_heads(_heads_first(q, k, v), shards)
    out_h, lse_h = _attend(qh, kh, vh, True, kernel)
    (out,) = _to_sequence([out_h], shards)
    return (_seq_first(out, owned=True), _seq_first(qh), _seq_first(kh), _seq_first(vh),
            _seq_first(out_h, owned=True), lse_h.contiguous())


@torch.library.custom_op("dtrain::cp_a2a_attention_backward", mutates_args=())
def _a2a_attention_backward(dout: torch.Tensor, qh: torch.Tensor, kh: torch.Tensor,
                            vh: torch.Tensor, out_h: torch.Tensor, lse_h: torch.Tensor,
                            group: str, kernel: str
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shards = _shards(group)
    (dout_h,) = _to_heads(_heads_first(dout), shards)
    grads = _attend_backward(dout_h, *_heads_first(qh, kh, vh, out_h), lse_h, True, kernel)
    return tuple(_seq_first(g) for g in _to_sequence(grads, shards))


# ---- what the compiler and autograd see ---------------------------------------------------------

def _fake_out(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((b, h, s), dtype=_math_dtype(q)))


def _fake_grads(*tensors: torch.Tensor):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


_ring_attention.register_fake(lambda q, k, v, group, kernel: _fake_out(q))
_all_gather_attention.register_fake(lambda q, k, v, group, kernel: _fake_out(q))


@_a2a_attention.register_fake
def _(q, k, v, group, kernel):
    n = _shards(group).size
    b, s, h, d = q.shape
    hk = k.shape[2]
    empty = partial(q.new_empty, dtype=q.dtype)
    return (empty((b, s, h, d)), empty((b, s * n, h // n, d)), empty((b, s * n, hk // n, d)),
            empty((b, s * n, hk // n, d)), empty((b, s * n, h // n, d)),
            q.new_empty((b, h // n, s * n), dtype=_math_dtype(q)))


for _backward_op in (_ring_attention_backward, _all_gather_attention_backward):
    _backward_op.register_fake(lambda dout, q, k, v, out, lse, group, kernel:
                               _fake_grads(q, k, v))


@_a2a_attention_backward.register_fake
def _(dout, qh, kh, vh, out_h, lse_h, group, kernel):
    n = _shards(group).size
    b, s, h, d = dout.shape
    hk = kh.shape[2] * n
    empty = partial(dout.new_empty, dtype=dout.dtype)
    return empty((b, s, h, d)), empty((b, s, hk, d)), empty((b, s, hk, d))


def _save_inputs_and_outputs(ctx, inputs, output) -> None:
    q, k, v, group, kernel = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group, ctx.kernel = group, kernel


def _save_head_split(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.group, ctx.kernel = inputs[3], inputs[4]


def _backward_with(op):
    def backward(ctx, dout, *unused):
        return (*op(dout.contiguous(), *ctx.saved_tensors, ctx.group, ctx.kernel), None, None)
    return backward


_ring_attention.register_autograd(_backward_with(torch.ops.dtrain.cp_ring_attention_backward),
                                  setup_context=_save_inputs_and_outputs)
_all_gather_attention.register_autograd(
    _backward_with(torch.ops.dtrain.cp_all_gather_attention_backward),
    setup_context=_save_inputs_and_outputs)
_a2a_attention.register_autograd(_backward_with(torch.ops.dtrain.cp_a2a_attention_backward),
                                 setup_context=_save_head_split)

# The operator of each comm type; selective activation checkpointing keeps their outputs
# (dtrain.parallel.activation_checkpoint).
CP_OPS = {"p2p": torch.ops.dtrain.cp_ring_attention,
          "all_gather": torch.ops.dtrain.cp_all_gather_attention,
          "a2a": torch.ops.dtrain.cp_a2a_attention}
CP_ATTENTION_OPS = tuple(op.default for op in CP_OPS.values())
