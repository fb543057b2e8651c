"""Step time of a layout: compute at a calibrated efficiency, the communication each
parallelism adds (volumes over NVLink inside a node, the network across nodes, the share not
hidden behind compute from ``constants``), the pipeline bubble and fixed overheads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.parallel.pipeline import ideal_bubble
from dtrain.plan.blocks import all_blocks, attention_flops, head_widths, model_flops_per_token
from dtrain.plan.constants import H200, Constants
from dtrain.plan.memory import Layout, Workload, fsdp_groups, local_params, pipeline_ranks


@dataclass
class TimeEstimate:
    """Seconds per optimizer step and its parts; tokens/s per GPU and MFU."""
    step: float
    compute: float
    bubble: float
    fsdp: float
    tp: float
    cp: float
    ep: float
    optimizer: float
    overhead: float
    tokens_per_second: float
    mfu: float
    microbatches: int = 1
    traffic: dict[str, float] = field(default_factory=dict)
    """Bytes each GPU sends per step, by parallelism (``tp``, ``cp``, ``ep``, ``fsdp``)."""
    bandwidth: dict[str, float] = field(default_factory=dict)
    """GB/s per GPU of the ``tp``, ``cp`` and ``ep`` collectives."""
    fsdp_across_nodes: float = 0.0
    """The bytes of ``traffic["fsdp"]`` over meshes that span nodes."""


def _bandwidth(group: int, stride: int, gpus_per_node: int, c: Constants) -> float:
    """GB/s of a collective over ``group`` ranks spaced ``stride`` apart in the rank order."""
    return c.nvlink_gb_s if group * stride <= gpus_per_node else c.network_gb_s


def _ring(volume: float, group: int) -> float:
    """Bytes each rank moves in a ring all-gather / reduce-scatter of ``volume`` bytes."""
    return volume * (group - 1) / group


def _compute_time(work: Workload, layout: Layout, c: Constants) -> float:
    """Seconds of weight matmuls and causal attention (masked half skipped) per GPU and step."""
    args, seq = work.args, work.seq_len
    tokens_rank = work.global_batch * seq / layout.world  # tokens of compute per GPU and step
    flops = model_flops_per_token(args, seq)
    attention = attention_flops(args, seq)
    matmul_eff = c.matmul_efficiency * (c.fp8_matmul_speedup if layout.fp8 else 1.0)
    peak = c.peak_tflops * 1e12
    attention_eff = c.attention_efficiency  # context-parallel blocks run on the same kernel
    compute = tokens_rank * ((flops - attention) / (peak * matmul_eff)
                             + attention / 2 / (peak * attention_eff))
    compute *= 1 + {"none": 0.0, "op": c.recompute_op, "full": c.recompute_full}[layout.ac]
    return compute if layout.compiled else compute * c.eager_slowdown


def estimate_time(work: Workload, layout: Layout, gpus_per_node: int = 8,
                  c: Constants = H200) -> TimeEstimate:
    args = work.args
    seq = work.seq_len
    m = work.microbatches(layout)
    compute = _compute_time(work, layout, c)
    flops, peak = model_flops_per_token(args, seq), c.peak_tflops * 1e12

    # Mesh order (outermost first): pp, dp_replicate, dp_shard, cp, tp.
    tp_bw = _bandwidth(layout.tp, 1, gpus_per_node, c)
    cp_bw = _bandwidth(layout.cp, layout.tp, gpus_per_node, c)

    # Blocks per pipeline rank (the MTP depths too), and of those with experts.
    layers = len(all_blocks(args)) / layout.pp
    moe_layers = sum(map(args.is_moe_layer, all_blocks(args))) / layout.pp
    tokens_mb = layout.micro_batch * seq / layout.cp  # local tokens of one micro-batch
    h = args.dim
    # Tensor parallel: per block and micro-batch 2 all-gathers and 2 reduce-scatters of the
    # block's activations forward, as many backward (one more pair recomputed under AC).
    traffic: dict[str, float] = {}
    bandwidth = {"tp": tp_bw, "cp": cp_bw}
    tp_time = 0.0
    if layout.tp > 1:
        per_collective = _ring(tokens_mb * h * 2, layout.tp) / (tp_bw * 1e9)
        count = 8 + (0 if layout.ac == "none" else 2)
        tp_blocks = layers - moe_layers / 2  # an MoE keeps tokens sequence-sharded: half
        tp_time = c.tp_exposed * count * per_collective * tp_blocks * m
        traffic["tp"] = count * _ring(tokens_mb * h * 2, layout.tp) * tp_blocks * m
    # Context parallel: K/V around the ring (p2p) or all-to-alls (a2a), per block.
    cp_time = 0.0
    if layout.cp > 1:
        qk, v = head_widths(args)
        heads = args.n_heads if args.attention == "mla" else args.kv_heads  # MLA: per head
        kv = heads * (qk + v) / layout.tp  # a token's keys and values
        if layout.cp_comm_type == "a2a":
            q_out = args.n_heads * (qk + v) / layout.tp
            volume = tokens_mb * (q_out + kv) * 2 * 2  # q, out; k, v; fwd+bwd
            volume = _ring(volume, layout.cp)
        else:
            volume = (layout.cp - 1) * tokens_mb * kv * 2 * 3  # K/V fwd, K/V+dK/dV bwd
        cp_time = c.cp_exposed * volume / (cp_bw * 1e9) * layers * m
        traffic["cp"] = volume * layers * m
    # Expert parallel: dispatch and combine all-to-alls forward and backward, per MoE block.
    ep_time = 0.0
    if layout.ep > 1:
        ep_bw = bandwidth["ep"] = _bandwidth(layout.ep, layout.tp, gpus_per_node, c)
        volume = tokens_mb / layout.tp * args.moe_top_k * h * 2 * 4
        ep_time = c.ep_exposed * _ring(volume, layout.ep) / (ep_bw * 1e9) * moe_layers * m
        traffic["ep"] = _ring(volume, layout.ep) * moe_layers * m
    fsdp_exposed, fsdp_across = _fsdp_time(work, layout, gpus_per_node, c, compute, traffic)
    # Pipeline bubble, and the optimizer step (fused AdamW: ~28 bytes per local parameter).
    bubble = 0.0
    if layout.pp > 1:
        bubble = ideal_bubble(layout.pp_schedule, layout.pp, layout.pp_virtual_stages, m) * (
            compute + tp_time + cp_time + ep_time)
    local = local_params(args, layout, pipeline_ranks(args, layout)[0])
    optimizer = local * 28 / (c.hbm_gb_s * 1e9)
    overhead = c.step_overhead_s + c.microbatch_overhead_s * m * layout.pp_virtual_stages
    step = compute + tp_time + cp_time + ep_time + fsdp_exposed + bubble + optimizer + overhead
    tps = work.global_batch * seq / step / layout.world
    return TimeEstimate(step, compute, bubble, fsdp_exposed, tp_time, cp_time, ep_time,
                        optimizer, overhead, tps, tps * flops / peak, m, traffic, bandwidth,
                        fsdp_across)


def _fsdp_time(work: Workload, layout: Layout, gpus_per_node: int, c: Constants,
               compute: float, traffic: dict[str, float]) -> tuple[float, float]:
    """Exposed seconds of FSDP/HSDP per step on the first pipeline rank, and the bytes of it
    that cross nodes; adds its bytes to ``traffic["fsdp"]``. What dtrain runs
    (``dtrain.step``, ``dtrain.parallel.fsdp``, torch's ``fully_shard`` and pipelining):

    - gradient accumulation: every micro-batch all-gathers each unit's weights forward and again
      backward (once for the units that keep them: each stage's last block, the output layer),
      reduce-scatters its fp32 gradients and, under HSDP, all-reduces the shards over the
      replicas; hidden behind compute up to ``c.fsdp_exposed``;
    - a pipeline: torch's pipelining skips the reduce-scatter and the reshard after every
      backward but the step's last, so the forward reuses the weights the previous backward left
      gathered: one all-gather per unit and microbatch (its backward's) plus the first forward's,
      hidden like the above, and one reduce-scatter (and HSDP all-reduce) per step, after the
      last backward, not hidden."""
    m = work.microbatches(layout)
    weight = 1 if layout.fp8 else 2
    gather = reduce = across = 0.0  # seconds, seconds, bytes
    rep_bw = _bandwidth(layout.world // layout.pp, 1, gpus_per_node, c)
    for g in fsdp_groups(work.args, layout, pipeline_ranks(work.args, layout)[0]):
        if g.shards == 1:
            continue
        if layout.pp > 1:
            gathers, reductions = (m + 1) * (g.gathered - g.kept) + g.kept, 1
        else:
            gathers, reductions = m * (2 * g.gathered - g.kept), m
        gathered = _ring(gathers * weight, g.shards)
        scattered = reductions * _ring(g.gathered * 4, g.shards)
        replicas = reductions * 2 * _ring(g.gathered / g.shards * 4, g.replicas)
        traffic["fsdp"] = traffic.get("fsdp", 0.0) + gathered + scattered + replicas
        bw = (c.nvlink_gb_s if g.extent <= gpus_per_node else c.network_gb_s) * 1e9
        across += ((gathered + scattered if g.extent > gpus_per_node else 0.0)
                   + (replicas if layout.world // layout.pp > gpus_per_node else 0.0))
        gather += gathered / bw
        reduce += scattered / bw + replicas / (rep_bw * 1e9)
    if layout.pp > 1:
        return max(c.fsdp_exposed * gather, gather - compute) + reduce, across
    total = gather + reduce
    return max(c.fsdp_exposed * total, total - compute), across
