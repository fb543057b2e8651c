"""What one transformer block holds and computes, from the model's shape alone: its parameters
by how the parallel plans shard them, the activations it keeps for backward, and the attention
FLOPs of the MFU convention.

Blocks are numbered as the model numbers them: ``0 .. n_layers - 1`` are the layers (dense or
MoE, ``LlamaArgs.is_moe_layer``), ``n_layers .. n_layers + mtp_depths - 1`` the multi-token
prediction depths (``dtrain.models.mtp``: a block of the last layer's kind, plus the projection
of the concatenated embedding and hidden state and three norms). Attention is grouped-query
(``Attention``) or DeepSeek's multi-head latent attention (``dtrain.models.mla``), whose query
and key heads are wider than its value heads and whose down-projections stay whole under
tensor parallel.
"""

from __future__ import annotations

from collections.abc import Iterable

from dtrain.models.args import LlamaArgs

KINDS = ("tp", "replicated", "experts", "router")
"""How a block's parameters are sharded: split by tensor parallel, whole on every TP rank,
split by expert parallel (the routed experts), the router and the shared expert."""


def head_widths(args: LlamaArgs) -> tuple[int, int]:
    """Each head's query/key width and its value width (MLA: nope + rope, and v_head_dim)."""
    if args.attention == "mla":
        return args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    return args.head_dim, args.head_dim


def attention_params(args: LlamaArgs) -> tuple[int, int]:
    """(parameters split by tensor parallel, parameters whole on every TP rank) of one block's
    attention. GQA: wq, wk, wv, wo split (and their biases), wo's bias and the q/k norms whole.
    MLA: wq or wq_b, wkv_b and wo split; wq_a, q_norm, wkv_a, kv_norm (and biases) whole
    (``dtrain.parallel.tensor.latent_attention_plan``)."""
    h, heads = args.dim, args.n_heads
    qk, v = head_widths(args)
    out_bias = h if args.out_bias else 0
    if args.attention == "mla":
        q_in = args.q_lora_rank or h
        split = (q_in * heads * qk + args.kv_lora_rank * heads * (args.qk_nope_head_dim + v)
                 + heads * v * h)
        latent = args.kv_lora_rank + args.qk_rope_head_dim
        whole = h * latent + args.kv_lora_rank + (latent if args.qkv_bias else 0)
        if args.q_lora_rank:
            whole += (h + 1 + (1 if args.qkv_bias else 0)) * args.q_lora_rank
        return split, whole + out_bias
    q, kv = heads * qk, args.kv_heads * qk
    split = 2 * h * q + 2 * h * kv + (q + 2 * kv if args.qkv_bias else 0)
    return split, out_bias + (2 * qk if args.qk_norm else 0)


def layer_params(args: LlamaArgs, block: int | None = None) -> dict[str, float]:
    """Parameters of ``block`` by ``KINDS``: the attention, the two norms, the dense
    feed-forward (split) or the MoE (experts; router and shared expert), and for an MTP depth its
    projection and three norms (whole: ``dtrain.parallel.tensor.MTP_PLAN``). ``None``: the mean
    over the model's ``n_layers`` layers."""
    if block is None:
        total = blocks_params(args, range(args.n_layers))
        return {kind: value / args.n_layers for kind, value in total.items()}
    h = args.dim
    split, whole = attention_params(args)
    p = {"tp": float(split), "replicated": float(2 * h + whole), "experts": 0.0, "router": 0.0}
    if args.is_moe_layer(block):
        p["experts"] = 3 * h * args.expert_dim * args.n_experts
        p["router"] = h * args.n_experts + 3 * h * args.moe_shared_hidden
    else:
        p["tp"] += 3 * h * args.ffn_dim
    if block >= args.n_layers:
        p["replicated"] += 2 * h * h + 3 * h
    return p


def _kind(args: LlamaArgs, block: int) -> tuple[bool, bool]:
    return args.is_moe_layer(block), block >= args.n_layers


def blocks_params(args: LlamaArgs, blocks: Iterable[int]) -> dict[str, float]:
    """``layer_params`` summed over ``blocks``."""
    kinds: dict[tuple[bool, bool], dict[str, float]] = {}
    total = dict.fromkeys(KINDS, 0.0)
    for block in blocks:
        key = _kind(args, block)
        if key not in kinds:
            kinds[key] = layer_params(args, block)
        for kind, value in kinds[key].items():
            total[kind] += value
    return total


def all_blocks(args: LlamaArgs) -> range:
    """Every block of the model: its layers, then its MTP depths."""
    return range(args.n_layers + args.mtp_depths)


def total_params(args: LlamaArgs) -> int:
    """Exact parameter count of the model, MTP depths included (``Transformer.num_params``)."""
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return round(sum(blocks_params(args, all_blocks(args)).values())) + embeddings + args.dim


def block_activation_elements(args: LlamaArgs, tokens: float, tp: int, block: int) -> float:
    """Elements (2 bytes each) ``block`` keeps for backward without checkpointing, for
    ``tokens`` tokens of a micro-batch (the whole sequence; sequence and tensor parallel split
    most of them over ``tp``), before the calibrated factors: the block input, the normed input,
    the residual and its norm; q, the keys and values expanded to every query head and the
    attention output; with MLA, the query and key/value latents before and after their norms,
    which every TP rank computes for the whole sequence; the feed-forward's three hidden tensors
    (for MoE, which runs on each rank's sequence shard, per routed copy with the dispatched input
    and output, and the shared expert's); for an MTP depth, its embedding input, the two
    normed halves it concatenates and its normed output."""
    h = args.dim
    qk, v = head_widths(args)
    sharded = 4 * h + args.n_heads * (2 * qk + 2 * v)
    whole = 0
    if args.attention == "mla":
        whole = 2 * (args.q_lora_rank or 0) + 2 * args.kv_lora_rank + args.qk_rope_head_dim
    if args.is_moe_layer(block):
        sharded += args.moe_top_k * (3 * args.expert_dim + 2 * h) + 3 * args.moe_shared_hidden
    else:
        sharded += 3 * args.ffn_dim
    if block >= args.n_layers:
        sharded += 4 * h
    return tokens * (sharded / tp + whole)


def attention_flops(args: LlamaArgs, seq_len: int) -> int:
    """Training FLOPs per token of attention scores and values in every block (the layers and
    the MTP depths), causal masking not discounted: 6 x heads x (qk + v head widths) x seq_len
    per block (12 x heads x head_dim x seq_len where the widths are equal)."""
    qk, v = head_widths(args)
    return 6 * (args.n_layers + args.mtp_depths) * args.n_heads * (qk + v) * seq_len


def model_flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """The MFU convention (``dtrain.metrics.model_flops_per_token``) from the shapes alone: 6 x
    the active non-embedding parameters (routed experts by top_k / n_experts; the output layer,
    once more for each MTP depth, which it serves too) + ``attention_flops``."""
    p = blocks_params(args, all_blocks(args))
    active = p["tp"] + p["replicated"] + p["router"]
    if args.n_experts:
        active += p["experts"] * args.moe_top_k / args.n_experts
    head = args.vocab_size * args.dim
    return 6 * (active + args.dim + head * (1 + args.mtp_depths)) + attention_flops(args, seq_len)
