"""The planner's constants in one table: hardware, efficiencies and memory overheads.

Efficiencies and overheads are calibrated to the 2x H200 figures of ``docs/benchmarks.md``
(Llama 3.1 8B, seq 8192; ``tests/test_plan.py`` checks the predictions against them). Change a
value here, or pass ``Constants(...)`` to the planner, to model other hardware.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constants:
    # Hardware (H100/H200 SXM, 8 GPUs per node on NVLink, 400 Gb/s InfiniBand per GPU).
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (the MFU reference)."""
    nvlink_gb_s: float = 360.0
    """Achieved bus bandwidth of collectives inside a node, GB/s per GPU."""
    network_gb_s: float = 40.0
    """Achieved bus bandwidth of collectives across nodes, GB/s per GPU."""
    hbm_gb_s: float = 4000.0
    """Achieved memory bandwidth (optimizer step), GB/s."""
    # Compute.
    matmul_efficiency: float = 0.555
    """Share of the peak reached by the weight matmuls of a compiled block."""
    attention_efficiency: float = 0.45
    """Share of the peak reached by causal attention (FLOPs counted without the masked half)."""
    eager_slowdown: float = 1.045
    """Step-time factor of eager (uncompiled) blocks."""
    fp8_matmul_speedup: float = 1.15
    """Weight-matmul speed-up of FP8 linears (tensorwise) over bf16."""
    recompute_op: float = 0.12
    """Extra compute of selective (op) checkpointing, as a share of the forward and backward."""
    recompute_full: float = 1 / 3
    """Extra compute of full checkpointing: one more forward."""
    fsdp_exposed: float = 0.10
    """Share of the FSDP all-gather / reduce-scatter time not hidden behind compute."""
    tp_exposed: float = 1.0
    """Share of the tensor-parallel collectives on the critical path (1.0: none hidden)."""
    cp_exposed: float = 0.35
    """Share of the context-parallel K/V traffic not hidden behind attention."""
    ep_exposed: float = 1.0
    """Share of the expert-parallel all-to-all on the critical path."""
    step_overhead_s: float = 0.03
    """Fixed time per optimizer step (host work, gradient norm, launch latency)."""
    microbatch_overhead_s: float = 0.004
    """Fixed time per micro-batch (launches, host syncs)."""
    # Memory.
    usable_memory: float = 0.85
    """Share of the GPU memory the allocated peak may reach (the rest: allocator caching,
    NCCL and CUDA context)."""
    act_none: float = 0.94
    """Saved activations without checkpointing, as a share of the tensor count in
    ``blocks.block_activation_elements``."""
    act_op: float = 0.22
    """The same with selective (op) checkpointing."""
    act_eager: float = 1.15
    """Activation factor of eager blocks over compiled ones (compile recomputes pointwise ops)."""
    act_fp8: float = 0.8
    """Activation factor of FP8 linears (their inputs are kept in float8 for backward)."""
    sp_gathered: float = 4.0
    """Tensors of a full hidden width per token and layer that sequence parallel keeps
    unsharded (gathered inputs of the column-parallel and partial outputs of the row-parallel
    matmuls)."""
    cp_saved_p2p: float = 0.7
    """Tensors of a full hidden width per local token and layer that context-parallel attention
    keeps besides the block's own, ring (p2p) and all-gather: its rotated q, k, v inputs and
    log-sum-exp."""
    cp_saved_a2a: float = 2.0
    """The same for the all-to-all (Ulysses): the head-split q, k, v and output over the whole
    sequence."""
    loss_bytes: float = 5.2
    """Bytes per token and vocabulary entry held by the output layer and loss (bf16 logits,
    their gradient, the loss's fp32 pieces), compiled; eager adds ``loss_bytes_eager``."""
    loss_bytes_eager: float = 9.0
    fsdp_buffer_blocks: float = 2.0
    """Unsharded blocks in flight under FSDP (current and prefetched)."""
    autocast_weight_bytes: float = 1.0
    """Without FSDP: bytes per local parameter of bf16 weight copies held during the step."""
    pp_stage_overhead: float = 0.35
    """Extra activation memory of a pipeline stage, as a share of one microbatch's stage
    activations (send/receive buffers, outputs kept for backward)."""
    workspace_gib: float = 0.5
    """cuBLAS/cuDNN workspaces and other fixed allocations."""


H200 = Constants()
