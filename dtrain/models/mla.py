"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2/V3), single-device code: tensor
parallel splits the heads from outside (``dtrain.parallel.tensor``).

Keys and values of all heads are expanded from one latent per token: ``wkv_a`` projects the
hidden state to ``kv_lora_rank`` latent channels and ``qk_rope_head_dim`` rotary key channels;
the latent, normalised by ``kv_norm``, goes through ``wkv_b`` to each head's ``qk_nope_head_dim``
key channels and ``v_head_dim`` value channels. The rotary key is one for all heads. Queries come
from one projection ``wq`` or, with ``q_lora_rank``, through a latent of their own (``wq_a``,
``q_norm``, ``wq_b``). Each head's query and key are its ``qk_nope_head_dim`` channels without
RoPE followed by its ``qk_rope_head_dim`` rotated ones; the values may be narrower or wider.

RoPE rotates Meta's interleaved pairs (2i, 2i+1) of the rotary channels (``apply_rope``). This is
DeepSeek's own layout, which transformers reads with ``rope_interleave`` (its default): it rotates
the same pairs and writes them back as two halves, in the same order for queries and keys, so
the attention logits are the same. Checkpoints laid out for ``rotate_half`` are permuted at import
(``dtrain.hf_deepseek``).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.models.args import LlamaArgs
from dtrain.models.norm import RMSNorm
from dtrain.models.rope import RopeScaling, apply_rope

# The latent norms keep RMSNorm's usual epsilon whatever norm_eps is, as DeepSeek's code (and
# transformers') builds them.
LATENT_NORM_EPS = 1e-6


def softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """The factor on q k^T: 1 / sqrt(qk_head_dim), times ``mscale ** 2`` with YaRN's
    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the scaling is YaRN with
    ``mscale_all_dim`` and ``factor`` > 1 (DeepSeek's rule: the scaling reaches the channels
    without RoPE too)."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim \
            and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale = scale * mscale * mscale
    return scale


def latent_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            backends: list[SDPBackend], scale: float) -> torch.Tensor:
    """Causal attention with one key and value per query head: q, k (batch, seq, heads,
    qk_head_dim), v (batch, seq, heads, v_head_dim) -> (batch, seq, heads, v_head_dim), through
    SDPA with the given kernels and softmax ``scale``."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(backends, set_priority=True) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=False)
    return out.transpose(1, 2)


class LatentAttention(nn.Module):
    """Multi-head latent attention of ``args`` (``attention="mla"``). Weights: ``wq``
    ``[n_heads * qk_head_dim, dim]``, or with ``q_lora_rank`` ``wq_a`` ``[q_lora_rank, dim]``,
    ``q_norm`` ``[q_lora_rank]`` and ``wq_b`` ``[n_heads * qk_head_dim, q_lora_rank]``; ``wkv_a``
    ``[kv_lora_rank + qk_rope_head_dim, dim]``, ``kv_norm`` ``[kv_lora_rank]``, ``wkv_b``
    ``[n_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``; ``wo``
    ``[dim, n_heads * v_head_dim]``. Rows of each head: no-RoPE channels, then rotary ones (q);
    key channels, then value channels (``wkv_b``). ``qkv_bias`` puts biases on ``wq_a`` and
    ``wkv_a``, ``out_bias`` on ``wo`` (DeepSeek's ``attention_bias``)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        if args.qk_rope_head_dim < 2 or args.qk_rope_head_dim % 2 or min(
                args.kv_lora_rank, args.qk_nope_head_dim, args.v_head_dim) < 1:
            raise ValueError("MLA needs kv_lora_rank, qk_nope_head_dim and v_head_dim >= 1 and "
                             f"an even qk_rope_head_dim >= 2, got {args.kv_lora_rank}, "
                             f"{args.qk_nope_head_dim}, {args.v_head_dim}, {args.qk_rope_head_dim}")
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = (
            args.n_heads, args.q_lora_rank, args.kv_lora_rank)
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.rope_kernel = args.rope_kernel
        q_width = args.n_heads * self.qk_head_dim
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=args.qkv_bias)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_width, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=args.qkv_bias)
        self.kv_norm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim),
                               bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=args.out_bias)
        # (q, k, v) -> output, all (batch, seq, heads, channels).
        self.core_attention = partial(
            latent_causal_attention, backends=args.sdpa_backends,
            scale=softmax_scale(self.qk_head_dim, args.rope_scaling))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, dim) and the RoPE cache (seq or more, qk_rope_head_dim // 2) ->
        (batch, seq, dim)."""
        batch, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank is None else self.wq_b(self.q_norm(self.wq_a(x)))
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q_nope, q_rope = q.view(batch, seq, -1, self.qk_head_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # Contiguous rotary channels: the RoPE kernel takes whole rows.
        q_rope = apply_rope(q_rope.contiguous(), rope, self.rope_kernel)
        k_rope = apply_rope(k_rope.unsqueeze(2).contiguous(), rope, self.rope_kernel)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.core_attention(q, k, v)
        return self.wo(out.reshape(batch, seq, -1))
