"""Per-GPU memory of a layout: parameters, gradients, optimizer state, activations, buffers.

The model: fp32 master weights and gradients and two fp32 AdamW moments (16 bytes per local
parameter), local parameters counted from the model's shapes as the parallel plans shard them
(TP splits attention and feed-forward matrices and the vocabulary; EP splits experts; FSDP
shards every weight over ``dp_shard x cp``, experts over the ranks outside ``ep``), block by
block (``dtrain.plan.blocks``: dense and MoE layers, MLA or GQA attention, the MTP depths) for
the blocks each pipeline rank holds (``pipeline_ranks``). Activations are counted per block and
token from the tensors each checkpointing mode keeps, scaled by calibrated factors
(``constants.Constants``), times the micro-batches in flight on each stage.
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
from dtrain.parallel.pipeline import V_SCHEDULES, parse_layout, stages_of_rank
from dtrain.plan.blocks import block_activation_elements, blocks_params, layer_params
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
    pp_layout: str = ""
    """The layers of each pipeline stage (``parallel.pp_layout``); "": an even split."""

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


@dataclass(frozen=True)
class RankStages:
    """The blocks one pipeline rank holds (``dtrain.plan.blocks`` numbering), stage by stage, the
    MTP depths after the layers of the stage with the output layer; and whether it holds the
    embedding (``first``) and the final norm and output layer (``last``)."""
    rank: int
    stages: tuple[tuple[int, ...], ...]
    first: bool
    last: bool

    @property
    def blocks(self) -> list[int]:
        return [block for stage in self.stages for block in stage]


def pipeline_ranks(args: LlamaArgs, layout: Layout) -> list[RankStages]:
    """Every pipeline rank's stages as the trainer builds them: the layers split by
    ``pp_layout`` (or evenly, earlier stages taking the remainder) over ``pp x v`` stages, held
    looped or V-shaped by the schedule (``dtrain.parallel.pipeline``); the MTP depths go with
    the output layer. Raises ConfigError for a layout that does not describe the model."""
    depths = tuple(range(args.n_layers, args.n_layers + args.mtp_depths))
    if layout.pp == 1:
        return [RankStages(0, (tuple(range(args.n_layers)) + depths,), True, True)]
    specs = parse_layout(layout.pp_layout, args.n_layers, layout.pp * layout.pp_virtual_stages)
    out = []
    for rank in range(layout.pp):
        held = [specs[i] for i in stages_of_rank(rank, layout.pp, layout.pp_virtual_stages,
                                                  layout.pp_schedule)]
        out.append(RankStages(rank, tuple(s.layers + (depths if s.output else ()) for s in held),
                              any(s.embedding for s in held), any(s.output for s in held)))
    return out


def rank_stages(args: LlamaArgs, layout: Layout, rank: int = 0) -> RankStages:
    """``pipeline_ranks``' entry of pipeline rank ``rank``."""
    return pipeline_ranks(args, layout)[rank]


def local_params(args: LlamaArgs, layout: Layout, ranks: RankStages) -> float:
    """Parameters one rank holds (its shards) of the blocks in ``ranks``, plus the embedding on
    the first stage and the final norm and output layer on the last."""
    p = blocks_params(args, ranks.blocks)
    stage_ranks = layout.world // layout.pp
    shards = layout.fsdp_shards
    total = (p["tp"] / layout.tp + p["replicated"]) / shards
    if args.n_experts:
        experts_over = stage_ranks if layout.ep > 1 else shards
        router_over = stage_ranks if layout.tp > 1 else shards
        total += p["experts"] / experts_over + p["router"] / router_over
    vocab = args.vocab_size * args.dim / layout.tp / shards
    if ranks.first:
        total += vocab
    if ranks.last:
        total += (0 if args.tie_embeddings and ranks.first else vocab) + args.dim / shards
    return total


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


def fsdp_groups(args: LlamaArgs, layout: Layout, ranks: RankStages) -> list[FsdpGroup]:
    """The FSDP meshes of a rank holding the blocks of ``ranks`` (and the embedding on the first
    stage, the final norm and output layer on the last), with the parameters it gathers from
    each; [] without FSDP (``ParallelDims.fsdp_enabled``). Each stage's last unit (its last
    block or MTP depth) and the output layer keep their weights from forward to backward. Mesh
    order, outermost first: pp, dp_replicate, dp_shard (split dp_shard_mod_ep x dp_shard_in_ep
    under ep), cp, tp."""
    if layout.dp * layout.cp == 1:
        return []
    stage_ranks = layout.world // layout.pp

    def sizes(blocks) -> tuple[float, float, float]:  # (dense, experts / ep, router) gathered
        p = blocks_params(args, blocks)
        dense = p["tp"] / layout.tp + p["replicated"]
        if args.n_experts and layout.ep == 1:
            dense += p["experts"] + p["router"]
        elif args.n_experts and layout.tp == 1:
            dense += p["router"]
        return dense, p["experts"] / layout.ep, p["router"]

    held = sizes(ranks.blocks)
    lasts = [sizes(stage[-1:]) for stage in ranks.stages]
    kept = [sum(last[i] for last in lasts) for i in range(3)]
    vocab = args.vocab_size * args.dim / layout.tp
    outer = ((0 if args.tie_embeddings and ranks.first else vocab) + args.dim
             if ranks.last else 0)
    dense = held[0] + (vocab if ranks.first else 0) + outer
    sharded = layout.dp_shard * layout.cp > 1
    out = [FsdpGroup("dense", dense, kept[0] + outer,
                     layout.dp_shard * layout.cp if sharded else layout.dp_replicate,
                     layout.dp_replicate if sharded else 1,
                     layout.tp * layout.cp * layout.dp_shard if sharded else stage_ranks)]
    if args.n_experts and layout.ep > 1:
        in_ep = layout.ep // layout.cp if layout.cp > 1 else layout.ep
        extent = (stage_ranks if layout.dp_replicate > 1 else
                  layout.tp * layout.cp * layout.dp_shard if layout.dp_shard > in_ep else
                  layout.tp)
        out.append(FsdpGroup("experts", held[1], kept[1], stage_ranks // layout.ep, 1, extent))
        if layout.tp > 1:
            out.append(FsdpGroup("router", held[2], kept[2], stage_ranks, 1, stage_ranks))
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


def activation_bytes(work: Workload, layout: Layout, c: Constants, ranks: RankStages) -> float:
    """Activation bytes of the pipeline rank holding ``ranks`` at the start of a backward pass:
    each stage's blocks times the micro-batches in flight on it, one block being recomputed,
    and on the last stage the output layer's logits and loss, computed once for the model and
    once more for each MTP depth."""
    args = work.args
    tokens = layout.micro_batch * work.seq_len / layout.cp
    sp_full = c.sp_gathered * args.dim * tokens * 2 if layout.tp > 1 else 0.0
    if layout.cp > 1:
        saved = c.cp_saved_a2a if layout.cp_comm_type == "a2a" else c.cp_saved_p2p
        sp_full += saved * args.dim / layout.tp * tokens * 2
    eager = (1.0 if layout.compiled else c.act_eager) * (c.act_fp8 if layout.fp8 else 1.0)
    overhead = 1 + (c.pp_stage_overhead if layout.pp > 1 else 0.0)
    in_flight = stage_microbatches(layout, work.microbatches(layout), ranks.rank)
    acts = working = 0.0
    for stage, count in zip(ranks.stages, in_flight, strict=True):
        for block in stage:
            full = block_activation_elements(args, tokens, layout.tp, block) * 2
            if layout.ac == "none":
                kept = (c.act_none * full + sp_full) * eager
            elif layout.ac == "op":
                kept = (c.act_op * full + sp_full) * eager
                working = max(working, c.act_none * full + sp_full)
            else:  # full: the block input only, and one block recomputed at a time
                kept = tokens * args.dim / layout.tp * 2
                working = max(working, c.act_none * full + sp_full)
            acts += count * kept * overhead
    acts += working
    if ranks.last:
        loss = c.loss_bytes + (0.0 if layout.compiled else c.loss_bytes_eager)
        acts += tokens * args.vocab_size / layout.tp * loss * (1 + args.mtp_depths)
    return acts


def stage_microbatches(layout: Layout, m: int, rank: int) -> list[float]:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once on each of its
    stages (in ``stages_of_rank`` order): all of them for GPipe; ``pp - rank`` for 1F1B; for
    the interleaved schedules the warm-up chunks of torch's schedule plus one, spread evenly;
    for the V schedules (ZBVZeroBubble, DualPipeV) ``2 pp - rank - 1`` on the rank's first
    stage and ``rank + 1`` on its second (DualPipeV's warm-up: 2 pp in all, as 1F1B's first
    rank)."""
    if layout.pp == 1:
        return [1.0]
    v = layout.pp_virtual_stages
    if layout.pp_schedule == "GPipe":
        return [float(m)] * v
    if layout.pp_schedule in V_SCHEDULES:
        return [float(min(2 * layout.pp - rank - 1, m)), float(min(rank + 1, m))]
    if v == 1:
        return [float(min(layout.pp - rank, m))]
    chunks = (v - 1) * layout.pp + 2 * (layout.pp - 1 - rank) + 1
    return [min(chunks, v * m) / v] * v


def estimate_memory(work: Workload, layout: Layout, c: Constants = H200) -> MemoryEstimate:
    """Peak allocated bytes per GPU: the largest of the first and the last pipeline rank and
    the rank holding the most blocks (the one with the most micro-batches in flight of
    those)."""
    ranks = pipeline_ranks(work.args, layout)
    busiest = max(ranks, key=lambda r: len(r.blocks))
    chosen = {ranks[0].rank: ranks[0], ranks[-1].rank: ranks[-1], busiest.rank: busiest}
    return max((rank_memory(work, layout, c, r) for r in chosen.values()),
               key=lambda est: est.peak)


def _pipeline_fsdp_buffers(args: LlamaArgs, layout: Layout, c: Constants, ranks: RankStages,
                           block: float) -> float:
    """FSDP's bytes on a pipeline rank when a backward starts: every unit's unsharded fp32
    gradient accumulator; gathered weights of the units that keep them, of the rank's other
    stages (their last backward left them gathered: (v - 1) / v of the rest), and of the blocks
    prefetched; one block's bf16 gradient before it is added."""
    groups = fsdp_groups(args, layout, ranks)
    gathered, kept = sum(g.gathered for g in groups), sum(g.kept for g in groups)
    v = layout.pp_virtual_stages
    held = kept + (gathered - kept) * (v - 1) / v + c.fsdp_buffer_blocks * block
    return 4 * gathered + (1 if layout.fp8 else 2) * held + 2 * block


def rank_memory(work: Workload, layout: Layout, c: Constants,
                ranks: RankStages) -> MemoryEstimate:
    """Peak bytes of the pipeline rank holding ``ranks`` (``pipeline_ranks``)."""
    args = work.args
    n = local_params(args, layout, ranks)
    params, grads, optimizer = 4 * n, 4 * n, 8 * n
    acts = activation_bytes(work, layout, c, ranks)
    fsdp = layout.world // layout.pp > 1 and layout.fsdp_shards > 1
    block = max((_gathered_block(args, layout, b) for b in ranks.blocks), default=0.0)
    weight_bytes = 1 if layout.fp8 else 2
    if fsdp and layout.pp > 1:
        buffers = _pipeline_fsdp_buffers(args, layout, c, ranks, block)
    elif fsdp:
        buffers = c.fsdp_buffer_blocks * block * weight_bytes + block * 4
        if ranks.last:  # the output layer gathered, and its gradient before the reduce-scatter
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


def _gathered_block(args: LlamaArgs, layout: Layout, block: int) -> float:
    """Parameters of ``block`` one rank holds once FSDP has gathered them."""
    p = layer_params(args, block)
    return p["tp"] / layout.tp + p["replicated"] + p["router"] + p["experts"] / max(layout.ep, 1)
