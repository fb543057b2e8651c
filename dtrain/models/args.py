"""``LlamaArgs``: the shape of every model ``dtrain.models.llama.Transformer`` builds."""

from __future__ import annotations

from dataclasses import dataclass

from torch.nn.attention import SDPBackend

from dtrain.models.rope import RopeScaling

SDPA_BACKENDS = {  # attention_backend -> the SDPA kernels it allows, in priority order
    "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
}


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
    # DeepSeek-V3's group-limited routing (sigmoid routers): the experts form moe_n_group equal
    # groups and each token takes its top k among those of its moe_topk_group best groups.
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scale: float = 1.0  # factor on the routed experts' weights (routed_scaling_factor)
    # The load-balancing loss over each forward's tokens ("aux_loss", Switch's) or over each
    # sequence's ("seq_aux_loss", DeepSeek-V3's complementary sequence-wise loss).
    moe_aux_loss_type: str = "aux_loss"
    # Attention: "gqa" (grouped-query heads, ``Attention``) or "mla" (DeepSeek's multi-head
    # latent attention, ``dtrain.models.mla``); the fields below are MLA's and unused by "gqa".
    attention: str = "gqa"
    q_lora_rank: int | None = None  # queries through a latent of this width; None: one wq
    kv_lora_rank: int = 0  # width of the latent keys and values are expanded from
    qk_nope_head_dim: int = 0  # each head's query/key channels without RoPE
    qk_rope_head_dim: int = 0  # each head's query/key channels with RoPE (the key's shared)
    v_head_dim: int = 0  # each head's value width
    # Multi-token prediction (DeepSeek-V3, ``dtrain.models.mtp``): mtp_depths extra blocks, the
    # k-th predicting the token k + 1 places past the next; their mean loss enters the gradient
    # times mtp_loss_weight.
    mtp_depths: int = 0
    mtp_loss_weight: float = 0.1

    def __post_init__(self):
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"attention {self.attention!r}: use gqa or mla")
        if self.moe_aux_loss_type not in ("aux_loss", "seq_aux_loss"):
            raise ValueError(f"moe_aux_loss_type {self.moe_aux_loss_type!r}: use aux_loss or "
                             "seq_aux_loss")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id``'s feed-forward is the MoE (else ``FeedForward``). The
        multi-token prediction depths' blocks (``n_layers`` on) are of the last block's kind."""
        if layer_id >= self.n_layers:
            layer_id = self.n_layers - 1
        return bool(self.n_experts) and (self.moe_layers is None or layer_id in self.moe_layers)

    @property
    def rope_dim(self) -> int:
        """The channels of each head RoPE rotates: qk_rope_head_dim with MLA, else head_dim."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def sdpa_backends(self) -> list[SDPBackend]:
        """The SDPA kernels ``attention_backend`` names, in priority order."""
        return SDPA_BACKENDS[self.attention_backend]

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
