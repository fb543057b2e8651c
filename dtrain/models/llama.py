"""Llama-family decoder (LLaMA 2/3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE), single-device
code: parallelism is applied from outside (dtrain.parallel).

The shapes differ only in ``LlamaArgs`` fields: the head width (``head_size``), biases on the
attention projections (``qkv_bias``, ``out_bias``), per-head RMSNorm of q and k (``qk_norm``),
RoPE scaling (Llama 3.1's or YaRN) and which blocks' feed-forward is a mixture of experts
(``n_experts``, ``moe_layers``).

Blocks live in a ``ModuleDict`` keyed "0".."n-1" so names stay stable when a pipeline stage drops
some; ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` by a stage and ``forward``
still works (it then takes and returns hidden states).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtrain.kernels.rope import kernel_applies as rope_kernel_applies
from dtrain.kernels.rope import rope, rotate_pairs
from dtrain.models import init
from dtrain.models.feed_forward import FeedForward
from dtrain.models.moe import MoE, compute_dtype


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    attention_backend: str = "auto"
    rope_kernel: bool = True  # RoPE through dtrain.kernels.rope (a Triton kernel on CUDA)
    ffn_hidden_size: int | None = None  # explicit FFN width (HF checkpoints); else Llama's rule
    head_size: int | None = None  # each attention head's width; None: dim // n_heads
    qkv_bias: bool = False  # biases on wq, wk, wv (Qwen2)
    out_bias: bool = False  # bias on wo
    qk_norm: bool = False  # RMSNorm over head_dim of each head's q and k, before RoPE (Qwen3)
    # Mixture of experts (dtrain.models.moe): n_experts > 0 replaces the feed-forward of the
    # blocks in moe_layers (None: every block) by an MoE; the others stay dense.
    n_experts: int = 0
    moe_layers: tuple[int, ...] | None = None
    moe_top_k: int = 2
    moe_hidden_size: int | None = None  # each expert's width; else ffn_dim
    moe_router: str = "softmax"  # softmax (Mixtral) or sigmoid with expert bias (DeepSeek)
    moe_norm_topk: bool = True  # renormalise the top-k softmax weights to sum to one
    moe_shared_hidden: int = 0  # width of a shared expert every token takes (0: none)
    moe_capacity_factor: float = 0.0  # 0: dropless
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_gemm: str = "auto"  # auto (grouped GEMM where fast), grouped, loop
    moe_aux_grad_scale: float = 1.0  # aux-loss gradient per forward: 1 / micro-batches per step

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id``'s feed-forward is the MoE (else ``FeedForward``)."""
        return bool(self.n_experts) and (self.moe_layers is None or layer_id in self.moe_layers)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        """Llama's rule: 2/3 of 4*dim, scaled by ffn_dim_multiplier, rounded up to multiple_of
        (unless ffn_hidden_size is given)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def expert_dim(self) -> int:
        return self.moe_hidden_size or self.ffn_dim


@dataclass
class RopeScaling:
    """Frequency scaling of RoPE for a context ``factor`` times the ``original_max_seq_len`` the
    model was trained with, as Hugging Face transformers computes it (``modeling_rope_utils``).

    ``kind="llama3"`` (Llama 3.1): wavelengths above original / ``low_freq_factor`` are
    stretched by ``factor``, those below original / ``high_freq_factor`` kept, those between
    blended. ``kind="yarn"``: frequencies that turn fewer than ``beta_slow`` times over the
    original context are stretched, more than ``beta_fast`` times kept, with a linear ramp
    between (its ends rounded outwards with ``truncate``), and cos and sin scaled by the
    attention factor ``rope_attention_factor`` (from ``mscale`` and ``mscale_all_dim``)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ("llama3", "yarn"):
            raise ValueError(f"RoPE scaling kind {self.kind!r}: use llama3 or yarn")


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each pair of channels, shape (head_dim // 2,), float64."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    if scaling.kind == "yarn":
        return _yarn_frequencies(freqs, head_dim, theta, scaling)
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = ((scaling.original_max_seq_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    return torch.where(wavelen > low_wavelen, freqs / scaling.factor,
                       torch.where(wavelen < high_wavelen, freqs, blended))


def _yarn_frequencies(freqs: torch.Tensor, head_dim: int, theta: float,
                      scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend of ``freqs`` (extrapolated) and ``freqs / factor`` (interpolated): pair i
    is interpolated by ramp(i), 0 up to the pair that turns ``beta_fast`` times over the
    original context, 1 from the one that turns ``beta_slow`` times."""
    def pair_turning(rotations: float) -> float:  # fractional pair index with that many turns
        return (head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's ``0.1 ln(factor) + 1``, or with
    ``mscale`` and ``mscale_all_dim`` both set the ratio of that formula's value with each as
    its coefficient (DeepSeek); 1 without scaling or with llama3's."""
    if scaling is None or scaling.kind != "yarn":
        return 1.0

    def mscale(coefficient: float = 1.0) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * coefficient * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale()


def rope_cache(seq_len: int, head_dim: int, theta: float,
               scaling: RopeScaling | None) -> torch.Tensor:
    """attention_factor * exp(i * position * frequency) per position and channel pair, shape
    (seq_len, head_dim // 2), complex64: rotating q and k by it also scales both by YaRN's
    attention factor (1 otherwise)."""
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64),
                         rope_frequencies(head_dim, theta, scaling))
    magnitude = torch.full_like(angles, rope_attention_factor(scaling))
    return torch.polar(magnitude, angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, cache: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """Rotates channel pairs (2i, 2i+1) of x (batch, seq, heads, head_dim) by the cached angles
    (Meta's interleaved layout), in fp32 for 16-bit x.

    ``kernel``: the ``dtrain::rope`` custom op, a Triton kernel on CUDA (``dtrain.kernels``)
    that reads and writes whole rows, where Inductor's code for the pairs loads every other
    channel. Otherwise, eager: one complex multiply (three kernels); under ``torch.compile``:
    the same products in real arithmetic, which Inductor fuses into one kernel with the casts
    around them (it has no code generation for complex tensors)."""
    cache = cache[: x.shape[1]]
    if kernel and rope_kernel_applies(x):
        return rope(x, torch.view_as_real(cache))
    cache = cache[:, None, :]
    real = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 rotates in fp32
    if torch.compiler.is_compiling():
        return rotate_pairs(real, torch.view_as_real(cache)).type_as(x)
    pairs = torch.view_as_complex(real.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * cache.to(pairs.dtype)).flatten(-2).type_as(x)


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers compile and checkpointing insert, so weight init
    and checkpoints see the same names on every configuration."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


_BACKENDS = {
    "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


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


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed with its weight in the input's dtype: under autocast on fp32
    weights (one GPU, no FSDP) the activations are bf16, and a weight of another dtype would
    send ``rms_norm`` to its slower unfused kernel. FSDP's mixed precision computes the same (its
    weights arrive in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads: wq ``[n_heads * head_dim, dim]``,
    wk and wv ``[kv_heads * head_dim, dim]``, wo ``[dim, n_heads * head_dim]``; with ``qk_norm``
    ``q_norm`` and ``k_norm`` (weights of head_dim) normalise each head before the rotation."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.backends = _BACKENDS[args.attention_backend]
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
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe_layer(layer_id):
            self.feed_forward: FeedForward | MoE = MoE(
                args.dim, args.expert_dim, args.n_experts, args.moe_top_k, args.moe_router,
                args.moe_norm_topk, args.moe_shared_hidden, args.moe_capacity_factor,
                args.moe_aux_loss_coeff, args.moe_z_loss_coeff, args.moe_gemm,
                args.moe_aux_grad_scale)
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
        self.register_buffer("rope", rope_cache(args.max_seq_len, args.head_dim, args.rope_theta,
                                                args.rope_scaling), persistent=False)
        # The positions a forward without ``positions`` uses (None: 0..seq-1): context parallel
        # sets this rank's (``dtrain.parallel.context.apply_cp``).
        self.positions: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) int64 -> logits (batch, seq, vocab); a pipeline stage without
        embeddings takes hidden states, one without ``output`` returns them. ``positions``
        (seq,) int64: the tokens' places in the whole sequence (context parallel holds parts of
        it); None means 0..seq-1."""
        if self.tok_embeddings is not None:
            # The residual stream in the compute dtype: autocast leaves an embedding of fp32
            # weights in fp32 (FSDP's bf16 weights give bf16, as here).
            h = self.tok_embeddings(tokens)
            h = h.to(compute_dtype(h))
        else:
            h = tokens
        positions = self.positions if positions is None else positions
        rope = self.rope if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fills every parameter from ``seed`` alone (see ``dtrain.models.init``) and rebuilds
        the RoPE cache, so a model materialised from ``meta`` by ``to_empty`` is ready to train.

        Scheme: embeddings N(0, 1) (N(0, 0.02) when tied to the output); q/k/v/w1 N(0, 0.02);
        wo/w2/w3 N(0, 0.02 / sqrt(2 (l + 1))) (depth-scaled); output N(0, dim^-1/2); all
        truncated at 3 sigma except the embeddings. Norms (q_norm, k_norm too) one, biases
        zero. MoE: the router gate N(0, 0.02), experts' w1/w2/w3 as the dense ones (each
        ``[n_experts, ...]`` tensor is one parameter)."""
        args = self.args
        device = buffer_device or self.rope.device
        self.rope = rope_cache(args.max_seq_len, args.head_dim, args.rope_theta,
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
            elif leaf in ("wq", "wk", "wv", "w1", "gate"):
                init.normal_(param, 0.02, seed, name, cutoff=3.0)
            else:  # wo, w2, w3
                layer_id = int(name.split(".")[1])
                init.normal_(param, 0.02 / math.sqrt(2 * (layer_id + 1)), seed, name, cutoff=3.0)
        for module in self.modules():  # buffers that to_empty left uninitialised
            if isinstance(module, MoE):
                module.reset_stats()
                if module.router.score == "sigmoid":
                    module.router.expert_bias.zero_()

    def num_params(self, exclude_embedding: bool = False, active: bool = False) -> int:
        """Parameter count (shared weights once); with exclude_embedding, without the input
        embedding table unless it is tied to the output layer; with ``active``, counting the
        routed experts' weights by the share a token uses (top_k / n_experts); dense blocks, the
        shared expert and the router count in full."""
        total = 0
        for name, p in self.named_parameters():
            routed = active and ".experts." in canonical_name(name)
            total += p.numel() * self.args.moe_top_k // self.args.n_experts if routed \
                else p.numel()
        if exclude_embedding and self.tok_embeddings is not None and not self.args.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total
