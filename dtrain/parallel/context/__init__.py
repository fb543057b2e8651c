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

Inputs of the attention are (batch, local seq, heads, width), K/V with the model's (fewer)
KV heads: K/V are communicated, and attended, without grouped-query expansion. Values (and the
output) may be narrower or wider than queries and keys, and the softmax scale is each
attention's own: multi-head latent attention (``dtrain.models.mla``) has both. Blocks are
computed by the cuDNN or flash kernel (the first of the two in the model's attention backends;
both return the log-sum-exp that merging blocks needs, both take grouped K/V and the scale;
flash, which takes one width, gets zero-padded inputs: ``blocks.attend``), on CPU or in fp32 by
an exact math path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention import SDPBackend

from dtrain.config import ConfigError
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.parallel.context.ops import CP_ATTENTION_OPS, CP_OPS

COMM_TYPES = ("p2p", "all_gather", "a2a")
__all__ = ["COMM_TYPES", "CP_ATTENTION_OPS", "CP_OPS", "ContextParallelAttention", "apply_cp",
           "check_cp", "load_balanced_positions"]


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (int64, length seq_len / cp) of the tokens context-parallel rank ``rank`` holds:
    chunk ``rank`` then chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def check_cp(args: LlamaArgs, cp: int, tp: int, seq_len: int, comm_type: str) -> None:
    """Raises ConfigError when the sequence does not split into 2 cp (x tp) chunks, or, for
    ``a2a``, the (tensor-parallel local) heads of the model ``args`` describes do not split over
    cp."""
    if seq_len % (2 * cp * tp):
        what = f"2 x parallel.cp x parallel.tp = 2 x {cp} x {tp}" if tp > 1 \
            else f"2 x parallel.cp = 2 x {cp}"
        raise ConfigError(f"training.seq_len = {seq_len} is not divisible by {what} = "
                          f"{2 * cp * tp} (the sequence is cut into 2 chunks per context-parallel "
                          f"rank{', each split over tp' if tp > 1 else ''}): use a multiple of "
                          f"{2 * cp * tp}")
    if comm_type == "a2a":
        heads = [("n_heads", args.n_heads)]
        if args.attention != "mla":  # MLA expands its keys and values to every query head
            heads.append(("n_kv_heads", args.kv_heads))
        for name, value in heads:
            local = value // tp
            if local % cp:
                per_rank = f" / tp = {local} per tensor-parallel rank" if tp > 1 else ""
                raise ConfigError(
                    f"parallel.cp_comm_type = 'a2a' splits the heads over parallel.cp = {cp}, "
                    f"but the model's {name} ({value}{per_rank}) is not divisible by {cp}: use "
                    "cp_comm_type 'p2p' or 'all_gather', or a cp that divides the heads")


def apply_cp(model: Transformer, cp_mesh: DeviceMesh, comm_type: str, seq_len: int) -> None:
    """Replaces the core attention of each block (``model.blocks()``: the multi-token prediction
    depths' too) with context-parallel attention over ``cp_mesh``, with the module's own
    kernels and softmax scale, and sets ``model.positions`` to this rank's
    (``load_balanced_positions`` of ``seq_len``): the model rotates its tokens by them, and the
    trainer cuts each batch to them."""
    model.positions = load_balanced_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())
    for block in model.blocks():
        backends, scale = _core_attention_settings(block.attention)
        block.attention.core_attention = ContextParallelAttention(cp_mesh, comm_type, backends,
                                                                  scale)


def _core_attention_settings(attention: nn.Module) -> tuple[list[SDPBackend], float | None]:
    """The SDPA backends and softmax scale an attention module's own core attention was built
    with: the keywords of its ``functools.partial`` (``causal_attention`` of ``Attention``, which
    takes the default scale: None here; ``latent_causal_attention`` of ``LatentAttention``,
    whose scale YaRN may change)."""
    keywords = attention.core_attention.keywords
    return keywords["backends"], keywords.get("scale")


class ContextParallelAttention:
    """Causal attention of this rank's two chunks against the whole sequence.

    Each comm type is one custom operator (``torch.ops.dtrain.cp_*_attention``) with its backward
    another: ``torch.compile`` keeps the block in one graph around it, and selective activation
    checkpointing saves its outputs (``activation_checkpoint.SAVE_OPS``) so the recomputation in
    backward neither attends nor communicates again."""

    def __init__(self, cp_mesh: DeviceMesh, comm_type: str, backends: list,
                 scale: float | None = None):
        if comm_type not in COMM_TYPES:
            raise ConfigError(f"parallel.cp_comm_type = {comm_type!r}: use one of "
                              f"{', '.join(COMM_TYPES)}")
        self.group_name = cp_mesh.get_group().group_name
        self.comm_type = comm_type
        self.backends = backends
        self.scale = scale  # the factor on q k^T; None: 1 / sqrt(query width)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q and k (batch, local seq, heads, width), v of its own width, k and v with the KV
        heads -> the attention output of the local queries, (batch, local seq, heads, v's
        width)."""
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        op = CP_OPS[self.comm_type]
        return op(q, k, v, self.group_name, _kernel(q, self.backends), scale)[0]


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
