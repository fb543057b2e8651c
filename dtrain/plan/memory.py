"""Per-GPU memory of a layout: parameters, gradients, optimizer state, activations, buffers.

The model: fp32 master weights and gradients and two fp32 AdamW moments (16 bytes per local
parameter), local parameters counted from the model's shapes as the parallel plans shard them
(TP splits attention and feed-forward matrices and the vocabulary; EP splits experts; FSDP
shards every weight over ``dp_shard x cp``, experts over the ranks outside ``ep``). Activations
are counted per layer and token from the tensors each checkpointing mode keeps, scaled by
calibrated factors (``constants.Constants``), times the micro-batches a pipeline stage holds.
The peak is taken at the start of the backward pass (all activations, no gradients yet) or its
end (all gradients), whichever is larger; with several micro-batches per step the gradients
live through the whole step. Under a pipeline with FSDP, torch's pipelining skips the
reduce-scatter and the reshard after every backward but the step's last, so each FSDP unit of
the rank stays gathered after its first backward and keeps an unsharded fp32 gradient
accumulator until the step's end (``fsdp_groups``, counted in the buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.models.llama import LlamaArgs
from dtrain.plan.constants import H200, Constants

GIB = 2**30


@dataclass(frozen=True)
class Layout:
    """One parallel layout and its batch and memory settings (as in ``[parallel]``)."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    pp_virtual_stages: int = 1
    pp_schedule: str = "1F1B"
    micro_batch: int = 1
    ac: str = "op"
    compiled: bool = True
    fp8: bool = False
    cp_comm_type: str = "p2p"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_shard * self.dp_replicate

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def fsdp_shards(self) -> int:
        """Ranks a dense weight is sharded over (``ParallelDims.fsdp_mesh``)."""
        if self.dp_shard * self.cp > 1:
            return self.dp_shard * self.cp
        return self.dp_replicate

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}"]
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}" + (f" v{self.pp_virtual_stages}"
                                                  if self.pp_virtual_stages > 1 else ""))
        parts += [f"cp {self.cp}", f"ep {self.ep}", f"dp_shard {self.dp_shard}",
                  f"dp_replicate {self.dp_replicate}", f"mb {self.micro_batch}", f"ac {self.ac}"]
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: the model's shape, the sequence and the global batch (sequences)."""
    args: LlamaArgs
    seq_len: int
    global_batch: int

    def microbatches(self, layout: Layout) -> int:
        """Micro-batches per step on one rank (the pipeline's microbatches with pp > 1)."""
        return self.global_batch // (layout.micro_batch * layout.dp)


def layer_params(args: LlamaArgs) -> dict[str, float]:
    """Parameters of one transformer block by how they are sharded: ``tp`` (split by tensor
    parallel), ``replicated`` (norms), ``experts`` (split by expert parallel), ``router``."""
    h, q, kv = args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if args.qkv_bias else 0)
    replicated = 2 * h + (h if args.out_bias else 0) + (2 * args.head_dim if args.qk_norm else 0)
    dense = 3 * h * args.ffn_dim
    if not args.n_experts:
        return {"tp": attention + dense, "replicated": replicated, "experts": 0, "router": 0}
    # An MoE model's dense blocks (model.moe_layer_freq): averaged over the blocks.
    share = 1.0 if args.moe_layers is None else len(args.moe_layers) / args.n_layers
    return {"tp": attention + (1 - share) * dense, "replicated": replicated,
            "experts": share * 3 * h * args.expert_dim * args.n_experts,
            "router": share * (h * args.n_experts + 3 * h * args.moe_shared_hidden)}


def total_params(args: LlamaArgs) -> int:
    """Exact parameter count of the model (``Transformer.num_params``)."""
    per_layer = sum(layer_params(args).values())
    embeddings = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return round(args.n_layers * per_layer) + embeddings + args.dim


def stage_layers(args: LlamaArgs, layout: Layout, last: bool) -> int:
    """Layers on the first (or last) pipeline rank: earlier stages take the remainder."""
    stages = layout.pp * layout.pp_virtual_stages
    base, extra = divmod(args.n_layers, stages)
    if stages == 1:
        return args.n_layers
    # Rank 0 holds stages 0, pp, 2 pp, ...; the last rank pp - 1, 2 pp - 1, ...
    held = [s for s in range(stages) if s % layout.pp == (layout.pp - 1 if last else 0)]
    return sum(base + (1 if s < extra else 0) for s in held)


def local_params(args: LlamaArgs, layout: Layout, first: bool, last: bool,
                 layers: int) -> float:
    """Parameters one rank holds (its shards) for ``layers`` blocks, plus the embedding on the
    first stage and the final norm and output layer on the last."""
    p = layer_params(args)
    stage_ranks = layout.world // layout.pp
    shards = layout.fsdp_shards
    per_layer = (p["tp"] / layout.tp + p["replicated"]) / shards
    if args.n_experts:
        experts_over = stage_ranks if layout.ep > 1 else shards
        router_over = stage_ranks if layout.tp > 1 else shards
        per_layer += p["experts"] / experts_over + p["router"] / router_over
    total = layers * per_layer
    vocab = args.vocab_size * args.dim / layout.tp / shards
    if first:
        total += vocab
    if last:
        total += (0 if args.tie_embeddings and first else vocab) + args.dim / shards
    return total


def layer_activation_elements(args: LlamaArgs, tokens: float, layout: Layout) -> float:
    """Elements (2 bytes each) one block keeps for backward without checkpointing, for
    ``tokens`` local tokens, before the calibrated factors: the block input, the normed input,
    q, the expanded k and v, the attention output, the residual and its norm, and the
    feed-forward's three hidden tensors (for MoE, per routed copy, with the dispatched input
    and output)."""
    h = args.dim
    if args.n_experts:
        ffn = args.moe_top_k * (3 * args.expert_dim + 2 * h) + 3 * args.moe_shared_hidden
        ffn_split = 1  # experts are not split by tensor parallel
    else:
        ffn, ffn_split = 3 * args.ffn_dim, layout.tp
    sharded = 8 * h / layout.tp + ffn / ffn_split
    return tokens * sharded


@dataclass(frozen=True)
class FsdpGroup:
    """The FSDP units of one rank that share a mesh (``dtrain.parallel.fsdp.apply_fsdp``)."""
    name: str
    """``dense`` (blocks, embeddings, output: ``ParallelDims.fsdp_mesh``), ``experts``
    (``ep_fsdp``) or ``router`` (router and shared expert under tp: ``moe_fsdp``)."""
    gathered: float
    """Parameters the rank's units hold unsharded once all-gathered."""
    kept: float
    """The part of ``gathered`` in units that keep their weights from forward to backward (each
    stage's last block, and the output layer)."""
    shards: int
    """Ranks each parameter is sharded over (1: the units exist, nothing is communicated)."""
    replicas: int = 1
    """HSDP: the sharded gradients are all-reduced over this many replicas."""
    extent: int = 1
    """Consecutive ranks the mesh spans (one node when it is at most the GPUs per node)."""


def fsdp_groups(args: LlamaArgs, layout: Layout, layers: int, first: bool,
                last: bool) -> list[FsdpGroup]:
    """The FSDP meshes of a rank holding ``layers`` blocks (and the embedding on the first stage,
    the final norm and output layer on the last), with the parameters it gathers from each; []
    without FSDP (``ParallelDims.fsdp_enabled``). Mesh order, outermost first: pp, dp_replicate,
    dp_shard (split dp_shard_mod_ep x dp_shard_in_ep under ep), cp, tp."""
    if layout.dp * layout.cp == 1:
        return []
    p = layer_params(args)
    stage_ranks = layout.world // layout.pp
    stages = layout.pp_virtual_stages if layout.pp > 1 else 1
    dense_layer = p["tp"] / layout.tp + p["replicated"]
    router = p["router"]
    if args.n_experts and layout.ep == 1:
        dense_layer += p["experts"] + router
    elif args.n_experts and layout.tp == 1:
        dense_layer += router
    vocab = args.vocab_size * args.dim / layout.tp
    outer = (0 if args.tie_embeddings and first else vocab) + args.dim if last else 0
    dense = layers * dense_layer + (vocab if first else 0) + outer
    sharded = layout.dp_shard * layout.cp > 1
    out = [FsdpGroup("dense", dense, stages * dense_layer + outer,
                     layout.dp_shard * layout.cp if sharded else layout.dp_replicate,
                     layout.dp_replicate if sharded else 1,
                     layout.tp * layout.cp * layout.dp_shard if sharded else stage_ranks)]
    if args.n_experts and layout.ep > 1:
        in_ep = layout.ep // layout.cp if layout.cp > 1 else layout.ep
        extent = (stage_ranks if layout.dp_replicate > 1 else
                  layout.tp * layout.cp * layout.dp_shard if layout.dp_shard > in_ep else
                  layout.tp)
        expert_layer = p["experts"] / layout.ep
        out.append(FsdpGroup("experts", layers * expert_layer, stages * expert_layer,
                             stage_ranks // layout.ep, 1, extent))
        if layout.tp > 1:
            out.append(FsdpGroup("router", layers * router, stages * router, stage_ranks, 1,
                                 stage_ranks))
    return out


@dataclass
class MemoryEstimate:
    """Bytes per GPU (the busiest pipeline rank)."""
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    peak: float
    local_params: float

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in vars(self).items() if k != "local_params"}


def activation_bytes(work: Workload, layout: Layout, c: Constants, last: bool,
                     layers: int) -> float:
    """Activation bytes of the first (or last) pipeline rank at the start of a backward pass."""
    args = work.args
    tokens = layout.micro_batch * work.seq_len / layout.cp
    full_layer = layer_activation_elements(args, tokens, layout) * 2
    sp_full = c.sp_gathered * args.dim * tokens * 2 if layout.tp > 1 else 0.0
    if layout.cp > 1:
        saved = c.cp_saved_a2a if layout.cp_comm_type == "a2a" else c.cp_saved_p2p
        sp_full += saved * args.dim / layout.tp * tokens * 2
    eager = (1.0 if layout.compiled else c.act_eager) * (c.act_fp8 if layout.fp8 else 1.0)
    if layout.ac == "none":
        kept = (c.act_none * full_layer + sp_full) * eager
        working = 0.0
    elif layout.ac == "op":
        kept = (c.act_op * full_layer + sp_full) * eager
        working = c.act_none * full_layer + sp_full
    else:  # full: the block input only, and one block recomputed at a time
        kept = tokens * args.dim / layout.tp * 2
        working = c.act_none * full_layer + sp_full
    m = work.microbatches(layout)
    in_flight = _microbatches_in_flight(layout, m, last)
    per_microbatch = layers * kept * (1 + (c.pp_stage_overhead if layout.pp > 1 else 0.0))
    acts = in_flight * per_microbatch + working
    if last:
        loss = c.loss_bytes + (0.0 if layout.compiled else c.loss_bytes_eager)
        acts += tokens * args.vocab_size / layout.tp * loss
    return acts


def _microbatches_in_flight(layout: Layout, m: int, last: bool) -> float:
    """Micro-batches whose activations a rank holds at once, in units of its whole share of
    layers: all of them for GPipe, ``pp`` for 1F1B on the first rank (one on the last), and
    for the interleaved schedules the warm-up chunks of torch's schedule plus one."""
    if layout.pp == 1:
        return 1.0
    v = layout.pp_virtual_stages
    if layout.pp_schedule == "GPipe":
        return float(m)
    if v == 1:
        return 1.0 if last else float(min(layout.pp, m))
    rank = layout.pp - 1 if last else 0
    chunks = (v - 1) * layout.pp + 2 * (layout.pp - 1 - rank) + 1
    return min(chunks, v * m) / v


def estimate_memory(work: Workload, layout: Layout, c: Constants = H200) -> MemoryEstimate:
    """Peak allocated bytes per GPU, for the first and the last pipeline rank (the larger)."""
    best = None
    for last in ((False, True) if layout.pp > 1 else (True,)):
        est = rank_memory(work, layout, c, first=not last or layout.pp == 1, last=last)
        if best is None or est.peak > best.peak:
            best = est
    return best


def _pipeline_fsdp_buffers(args: LlamaArgs, layout: Layout, c: Constants, first: bool,
                           last: bool, layers: int, block: float) -> float:
    """FSDP's bytes on a pipeline rank when a backward starts: every unit's unsharded fp32
    gradient accumulator; gathered weights of the units that keep them, of the rank's other
    stages (their last backward left them gathered: (v - 1) / v of the rest), and of the blocks
    prefetched; one block's bf16 gradient before it is added."""
    groups = fsdp_groups(args, layout, layers, first, last)
    gathered, kept = sum(g.gathered for g in groups), sum(g.kept for g in groups)
    v = layout.pp_virtual_stages
    held = kept + (gathered - kept) * (v - 1) / v + c.fsdp_buffer_blocks * block
    return 4 * gathered + (1 if layout.fp8 else 2) * held + 2 * block


def rank_memory(work: Workload, layout: Layout, c: Constants, first: bool,
                last: bool) -> MemoryEstimate:
    """Peak bytes of a rank holding the first and/or the last pipeline stage."""
    args = work.args
    layers = stage_layers(args, layout, last and layout.pp > 1)
    n = local_params(args, layout, first, last, layers)
    params, grads, optimizer = 4 * n, 4 * n, 8 * n
    acts = activation_bytes(work, layout, c, last, layers)
    fsdp = layout.world // layout.pp > 1 and layout.fsdp_shards > 1
    p = layer_params(args)
    block = (p["tp"] / layout.tp + p["replicated"] + p["router"]
             + p["experts"] / max(layout.ep, 1))
    weight_bytes = 1 if layout.fp8 else 2
    if fsdp and layout.pp > 1:
        buffers = _pipeline_fsdp_buffers(args, layout, c, first, last, layers, block)
    elif fsdp:
        buffers = c.fsdp_buffer_blocks * block * weight_bytes + block * 4
        if last:  # the output layer gathered, and its gradient before the reduce-scatter
            buffers += args.vocab_size * args.dim / layout.tp * (2 + 4)
    else:
        buffers = c.autocast_weight_bytes * n
    buffers += c.workspace_gib * GIB
    static = params + optimizer
    if work.microbatches(layout) > 1 or layout.pp > 1:
        peak = static + grads + acts + buffers
    else:
        peak = static + max(acts, grads) + buffers
    return MemoryEstimate(params, grads, optimizer, acts, buffers, peak, n)

