"""Llama-family decoder (LLaMA 2/3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3),
single-device code: parallelism is applied from outside (dtrain.parallel).

The shapes differ only in ``LlamaArgs`` fields (``dtrain.models.args``): the head width
(``head_size``), biases on the attention projections (``qkv_bias``, ``out_bias``), per-head RMSNorm
of q and k (``qk_norm``), RoPE scaling (Llama 3.1's or YaRN, ``dtrain.models.rope``), DeepSeek's
multi-head latent attention in place of grouped-query heads (``attention="mla"``,
``dtrain.models.mla``) and which blocks' feed-forward is a mixture of experts (``n_experts``,
``moe_layers``).

Blocks live in a ``ModuleDict`` keyed "0".."n-1" so names stay stable when a pipeline stage drops
some; ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` by a stage and ``forward``
still works (it then takes and returns hidden states).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.models import init
from dtrain.models.args import LlamaArgs
from dtrain.models.feed_forward import FeedForward
from dtrain.models.mla import LatentAttention
from dtrain.models.moe import MoE, compute_dtype
from dtrain.models.mtp import MTPDepth
from dtrain.models.norm import RMSNorm
from dtrain.models.rope import (
    RopeScaling,
    apply_rope,
    rope_attention_factor,
    rope_cache,
    rope_frequencies,
)

# The model's public names, those of the RoPE, norm and arguments modules it is built from too.
__all__ = ["Attention", "LlamaArgs", "RMSNorm", "RopeScaling", "Transformer", "TransformerBlock",
           "apply_rope", "canonical_name", "causal_attention", "expand_kv", "rope_attention_factor",
           "rope_cache", "rope_frequencies", "takes_grouped_kv"]


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers compile and checkpointing insert, so weight init
    and checkpoints see the same names on every configuration."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def expand_kv(k: torch.Tensor, v: torch.Tensor,
              repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each KV head of k, v (batch, seq, kv_heads, head_dim) serves
    ``repeat`` query heads. expand + reshape, not repeat_interleave: its backward is a sum,
    not a scatter-add."""
    if repeat == 1:
        return k, v
    return tuple(t.unsqueeze(3).expand(-1, -1, -1, repeat, -1).flatten(2, 3) for t in (k, v))


def takes_grouped_kv(device_type: str, dtype: torch.dtype, backends: list[SDPBackend]) -> bool:
    """Whether the SDPA kernel that runs for queries of this device and dtype under ``backends``
    (in priority order) takes fewer KV heads than query heads: the CPU kernels, math, and on
    CUDA cuDNN and flash (16-bit only); not the memory-efficient kernel, which SDPA would
    otherwise skip for math."""
    if device_type != "cuda":
        return True
    for backend in backends:
        if backend == SDPBackend.MATH or (
                backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
                and dtype in (torch.float16, torch.bfloat16)):
            return True
        if backend == SDPBackend.EFFICIENT_ATTENTION:
            return False
    return True


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     backends: list[SDPBackend]) -> torch.Tensor:
    """Causal attention of the whole sequence: q (batch, seq, heads, head_dim), k and v with
    the KV heads -> (batch, seq, heads, head_dim), through SDPA with the given kernels.

    Grouped-query K/V go to the kernel as they are (``enable_gqa``): cuDNN and flash read each
    KV head once for its query heads and reduce dK/dV over the group themselves, where an
    expanded copy costs a copy kernel and four times the K/V reads (docs/benchmarks.md has cuDNN's
    forward on each for Llama 3 8B). The memory-efficient kernel takes no grouped K/V: where it is
    the kernel to run, they are expanded."""
    gqa = k.shape[2] != q.shape[2]
    if gqa and not takes_grouped_kv(q.device.type, q.dtype, backends):
        k, v, gqa = *expand_kv(k, v, q.shape[2] // k.shape[2]), False
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(backends, set_priority=True) if q.is_cuda else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads: wq ``[n_heads * head_dim, dim]``,
    wk and wv ``[kv_heads * head_dim, dim]``, wo ``[dim, n_heads * head_dim]``; with ``qk_norm``
    ``q_norm`` and ``k_norm`` (weights of head_dim) normalise each head before the rotation."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.backends = args.sdpa_backends
        self.rope_kernel = args.rope_kernel
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=args.out_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        # (q, k, v) -> output, all (batch, seq, heads, head_dim); context parallel replaces it.
        self.core_attention = partial(causal_attention, backends=self.backends)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (apply_rope(t, rope, self.rope_kernel) for t in (q, k))
        out = self.core_attention(q, k, v)
        return self.wo(out.reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention: Attention | LatentAttention = (
            LatentAttention(args) if args.attention == "mla" else Attention(args))
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.feed_forward: FeedForward | MoE = MoE(
                args.dim, args.expert_dim, args.n_experts, args.moe_top_k, args.moe_router,
                args.moe_norm_topk, args.moe_shared_hidden, args.moe_capacity_factor,
                args.moe_aux_loss_coeff, args.moe_z_loss_coeff, args.moe_gemm,
                args.moe_aux_grad_scale, n_group=args.moe_n_group,
                topk_group=args.moe_topk_group, routed_scale=args.moe_routed_scale,
                aux_loss_type=args.moe_aux_loss_type)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args)
                                     for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Multi-token prediction depths (dtrain.models.mtp); a pipeline keeps them with the
        # output layer.
        self.mtp: nn.ModuleDict | None = nn.ModuleDict({
            str(k): MTPDepth(args, TransformerBlock(args.n_layers + k, args))
            for k in range(args.mtp_depths)}) if args.mtp_depths else None
        self.register_buffer("rope", rope_cache(args.max_seq_len, args.rope_dim, args.rope_theta,
                                                args.rope_scaling), persistent=False)
        # The positions a forward without ``positions`` uses (None: 0..seq-1): context parallel
        # sets this rank's (``dtrain.parallel.context.apply_cp``).
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab); a pipeline stage without
        embeddings takes hidden states, one without ``output`` returns them. ``positions``
        (seq,) int64: the tokens' places in the whole sequence (context parallel holds parts of
        it); None means 0..seq-1.

        With multi-token prediction depths, tokens (batch, seq, 1 + depths) (``mtp_columns``)
        give logits (batch x (1 + depths), seq, vocab): the model's, then each depth's; the
        hidden states between stages are then (batch, seq, 1 + depths, dim), the depths'
        embeddings carried along (``dtrain.models.mtp``)."""
        if self.tok_embeddings is not None:
            # The residual stream in the compute dtype: autocast leaves an embedding of fp32
            # weights in fp32 (FSDP's bf16 weights give bf16, as here).
            h = self.tok_embeddings(tokens)
            h = h.to(compute_dtype(h))
        else:
            h = tokens
        embedded = None
        if h.dim() == 4:  # the MTP depths' embeddings ride along
            h, embedded = h[:, :, 0], h[:, :, 1:]
        positions = self.positions if positions is None else positions
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h if embedded is None else torch.cat([h.unsqueeze(2), embedded], dim=2)
        if embedded is None or self.mtp is None:
            return self.output(h)
        hidden = [h]
        for k, depth in enumerate(self.mtp.values()):
            hidden.append(depth(hidden[-1], embedded[:, :, k], rope))
        return self.output(torch.cat(hidden, dim=0))

    def blocks(self) -> list[nn.Module]:
        """Every transformer block of this model (part): the layers', then the MTP depths'."""
        depths = list(self.mtp.values()) if self.mtp is not None else []
        return [*self.layers.values(), *(depth.block for depth in depths)]

    def wrap_blocks(self, wrap: Callable[[int, nn.Module], nn.Module]) -> None:
        """Replaces each block, in ``blocks()``'s order, by ``wrap(its index, block)`` (how
        activation checkpointing and compile wrap them)."""
        layers = list(self.layers.items())
        for i, (name, block) in enumerate(layers):
            self.layers[name] = wrap(i, block)
        for k, depth in enumerate(self.mtp.values() if self.mtp is not None else ()):
            depth.block = wrap(len(layers) + k, depth.block)

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fills every parameter from ``seed`` alone (see ``dtrain.models.init``) and rebuilds
        the RoPE cache, so a model materialised from ``meta`` by ``to_empty`` is ready to train.

        Scheme: embeddings N(0, 1) (N(0, 0.02) when tied to the output); q/k/v (MLA's wq_a,
        wq_b, wkv_a, wkv_b)/w1 N(0, 0.02); wo/w2/w3 N(0, 0.02 / sqrt(2 (l + 1))) (depth-scaled);
        output N(0, dim^-1/2); all truncated at 3 sigma except the embeddings. Norms (q_norm,
        k_norm, kv_norm too) one, biases zero. MoE: the router gate N(0, 0.02), experts'
        w1/w2/w3 as the dense ones (each ``[n_experts, ...]`` tensor is one parameter)."""
        args = self.args
        device = buffer_device or self.rope.device
        self.rope = rope_cache(args.max_seq_len, args.rope_dim, args.rope_theta,
                               args.rope_scaling).to(device)
        if self.positions is not None:
            self.positions = self.positions.to(device)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".")[-1]
            if name.endswith(".bias"):
                init.constant_(param, 0.0)
            elif "norm" in leaf:
                init.constant_(param, 1.0)
            elif leaf == "tok_embeddings":  # also the output layer when tied: keep logits small
                init.normal_(param, 0.02 if args.tie_embeddings else 1.0, seed, name)
            elif leaf == "output":
                init.normal_(param, args.dim ** -0.5, seed, name, cutoff=3.0)
            elif leaf in ("wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b", "w1", "gate",
                          "proj"):
                init.normal_(param, 0.02, seed, name, cutoff=3.0)
            else:  # wo, w2, w3
                layer_id = int(name.split(".")[1])
                if name.startswith("mtp."):  # MTP depth k's block comes after the layers
                    layer_id += args.n_layers
                init.normal_(param, 0.02 / math.sqrt(2 * (layer_id + 1)), seed, name, cutoff=3.0)
        for module in self.modules():  # buffers that to_empty left uninitialised
            if isinstance(module, MoE):
                module.reset_stats()
                if module.router.score == "sigmoid":
                    module.router.expert_bias.zero_()

    def num_params(self, exclude_embedding: bool = False, active: bool = False,
                   mtp: bool = True) -> int:
        """Parameter count (shared weights once); with exclude_embedding, without the input
        embedding table unless it is tied to the output layer; with ``active``, counting the
        routed experts' weights by the share a token uses (top_k / n_experts); dense blocks, the
        shared expert and the router count in full; without ``mtp``, the MTP depths do not
        count (published sizes leave them out)."""
        total = 0
        for name, p in self.named_parameters():
            if not mtp and canonical_name(name).startswith("mtp."):
                continue
            routed = active and ".experts." in canonical_name(name)
            total += p.numel() * self.args.moe_top_k // self.args.n_experts if routed \
                else p.numel()
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total
