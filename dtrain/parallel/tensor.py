"""Tensor parallel with sequence parallel (Megatron's --tensor-model-parallel-size with
--sequence-parallel), through DTensor ``parallelize_module`` plans on the plain model.

Between blocks the residual stream is sharded on the sequence dimension (``Shard(1)``): RMSNorm
runs on the local tokens. Entering attention or the feed-forward, the sequence is all-gathered;
``wq/wk/wv/w1/w3`` are column-parallel (each rank holds a slice of the heads / hidden units) and
``wo/w2`` row-parallel, whose partial sums are reduce-scattered back onto the sequence. Biases
follow their linears: a column-parallel bias is split with its rows, a row-parallel one is
replicated. Per-head q/k norms (``qk_norm``) run on this rank's heads with their head_dim weight
replicated. The embedding table is split by vocabulary rows; the output projection is
column-parallel over the vocabulary and, with loss parallel, its logits stay sharded: the
cross-entropy is computed on the vocabulary shards and full logits are never gathered.

DeepSeek's latent attention (``dtrain.models.mla``) splits its heads from the up-projections on:
``wq`` or ``wq_b`` and ``wkv_b`` column-parallel, ``wo`` row-parallel. The down-projections
``wq_a`` and ``wkv_a`` and the latent norms stay whole on every rank and compute on the gathered
sequence, so their gradients come out whole: the column-parallel inputs sum theirs over the
ranks, and the rotary key all heads share gets its sum from ``SharedRopeKey``.

Multi-token prediction depths (``dtrain.models.mtp``) take a block's plan for their block; their
norms and projection run on the sequence shard with replicated weights (``mtp_depth_plan``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtrain.config import ConfigError
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.models.mla import LatentAttention
from dtrain.models.moe import MoE
from dtrain.parallel.compile import fp8_output_layer


def check_tp(args: LlamaArgs, tp: int, seq_len: int) -> None:
    """Raises ConfigError when the heads of the model ``args`` describes, its feed-forward or
    the sequence do not split over ``tp``."""
    sizes = [("n_heads", args.n_heads)]
    if args.attention != "mla":  # MLA's keys and values have one head per query head
        sizes.append(("n_kv_heads", args.kv_heads))
    if not all(args.is_moe_layer(i) for i in range(args.n_layers)):  # a dense feed-forward
        sizes.append(("ffn hidden size", args.ffn_dim))
    for name, value in sizes:
        if value % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide the model's {name} ({value}): "
                              f"use a tensor-parallel degree that divides {value}")
    if seq_len % tp:
        raise ConfigError(f"training.seq_len = {seq_len} is not divisible by parallel.tp = {tp} "
                          "(sequence parallel splits the sequence): use a multiple of the degree")


def check_async_tp(device_type: str, compiled: bool) -> None:
    """Async TP is a torch.compile pass over CUDA symmetric memory: refuse it elsewhere."""
    if device_type != "cuda" or not compiled:
        raise ConfigError("parallel.async_tp = true needs CUDA GPUs and compile.enabled = true "
                          "(it is a torch.compile pass): enable compile, or set "
                          "parallel.async_tp = false")


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, loss_parallel: bool,
             float8: bool = False) -> None:
    """Shards ``model`` in place over ``tp_mesh``. With ``loss_parallel`` the model returns
    vocabulary-sharded logits as a DTensor (compute the loss under ``loss_parallel()``);
    otherwise it returns full logits as a plain tensor. ``float8``: see ``block_plan``."""
    parallelize_module(model, tp_mesh, top_plan(model, loss_parallel, float8))
    for depth in model.mtp.values() if model.mtp is not None else ():
        parallelize_module(depth, tp_mesh, mtp_depth_plan())
    for block in model.blocks():
        parallelize_module(block, tp_mesh, block_plan(block, float8))


def mtp_depth_plan() -> dict[str, ParallelStyle]:
    """The TP plan of a multi-token prediction depth around its block (which takes
    ``block_plan``): its norms and projection run per token on the sequence shard with their
    weights replicated, the gradients summed over the ranks by DTensor."""
    return {"enorm": SequenceParallel(), "hnorm": SequenceParallel(),
            "proj": SequenceParallel(use_local_output=True), "norm": SequenceParallel()}


def top_plan(model: Transformer, loss_parallel: bool,
             float8: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of the modules around the blocks: the embedding split by vocabulary rows,
    the final norm sequence-parallel, the output layer column-parallel over the vocabulary.
    With ``float8``, an FP8 output layer takes torchao's float8 style, as a block's linears do
    (its input all-gathered in FP8)."""
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        colwise = ColwiseParallel
        if float8 and fp8_output_layer(model):
            from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

            colwise = Float8ColwiseParallel
        top["output"] = colwise(input_layouts=Shard(1),
                                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                use_local_output=not loss_parallel)
    return top


def block_plan(block: nn.Module, float8: bool = False) -> dict[str, ParallelStyle]:
    """The TP plan of one transformer block. With ``float8`` (torchao tensorwise scaling), the
    FP8 linears take torchao's float8 styles: activations are cast to FP8 before the sequence
    all-gather, so it moves half the bytes. A module's input is all-gathered in FP8 only when
    every linear that reads it is FP8."""
    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    fp8: set[str] = set()
    if float8:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        fp8 = {name for name, m in block.named_modules() if isinstance(m, Float8Linear)}
        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, \
            PrepareFloat8ModuleInput

    def col(name: str) -> ParallelStyle:
        return (colwise if name in fp8 else ColwiseParallel)()

    def row(name: str) -> ParallelStyle:
        return (rowwise if name in fp8 else RowwiseParallel)(output_layouts=Shard(1))

    def gather(readers: list[str], layouts: tuple, desired: tuple) -> ParallelStyle:
        style = prepare if all(name in fp8 for name in readers) else PrepareModuleInput
        return style(input_layouts=layouts, desired_input_layouts=desired)

    if isinstance(block.attention, LatentAttention):
        attention = latent_attention_plan(block.attention, col, row)
    else:
        attention = {
            # The second input is the RoPE table, the same on every rank.
            "attention": gather(["attention.wq", "attention.wk", "attention.wv"],
                                (Shard(1), None), (Replicate(), None)),
            "attention.wq": col("attention.wq"),
            "attention.wk": col("attention.wk"),
            "attention.wv": col("attention.wv"),
            "attention.wo": row("attention.wo"),
        }
        if block.attention.q_norm is not None:
            # q and k arrive as this rank's heads (dim 2); each head is normalised over
            # head_dim with the one replicated weight.
            for norm in ("attention.q_norm", "attention.k_norm"):
                attention[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan = {
        "attention_norm": SequenceParallel(),
        **attention,
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather(["feed_forward.w1", "feed_forward.w3"],
                               (Shard(1),), (Replicate(),)),
        "feed_forward.w1": col("feed_forward.w1"),
        "feed_forward.w2": row("feed_forward.w2"),
        "feed_forward.w3": col("feed_forward.w3"),
    }
    if isinstance(block.feed_forward, MoE):
        # Tokens stay sequence-sharded through the MoE: each rank routes and dispatches its own
        # tokens (to the experts' ranks over ep), so the MoE runs on local tensors (and returns
        # the local shard of the residual stream, as the row-parallel layers do) and its
        # weights are not split over tp; their gradients are summed over the tp ranks by the
        # MoE's own FSDP units (dtrain.parallel.fsdp).
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    return plan


def latent_attention_plan(attention: LatentAttention, col: Callable[[str], ParallelStyle],
                          row: Callable[[str], ParallelStyle]) -> dict[str, ParallelStyle]:
    """The TP plan of a block's ``LatentAttention``: the sequence gathered into a plain tensor,
    on which ``wq_a``, ``q_norm``, ``wkv_a`` (``SharedRopeKey``) and ``kv_norm`` compute with
    their whole weights; ``wq`` or ``wq_b`` and ``wkv_b`` column-parallel over the heads (``col``
    gives the style of a linear), ``wo`` row-parallel (``row``)."""
    q = "attention.wq" if attention.q_lora_rank is None else "attention.wq_b"
    return {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                        desired_input_layouts=(Replicate(), None),
                                        use_local_output=True),
        q: col(q),
        "attention.wkv_a": SharedRopeKey(attention.rope_dim),
        "attention.wkv_b": col("attention.wkv_b"),
        "attention.wo": row("attention.wo"),
    }


class SharedRopeKey(ParallelStyle):
    """MLA's ``wkv_a`` under tensor parallel: its weight stays whole on every rank, and in
    backward the gradient of its output's last ``rope_dim`` channels, the rotary key all heads
    share, is summed over the ranks (each rank's heads add only theirs). The latent channels
    need no sum: the column-parallel ``wkv_b`` they reach sums its input's gradient."""

    def __init__(self, rope_dim: int):
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def sum_rope_gradient(module: nn.Module, inputs: tuple, output: torch.Tensor):
            latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], -1)
            # Forward: the same tensor; backward: the Partial gradient all-reduced.
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False) \
                .to_local(grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(sum_rope_gradient)
        return module


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Micro-pipelined TP under torch.compile: the all-gathers and reduce-scatters around the
    TP matmuls are split and overlapped with them through symmetric memory (CUDA only)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
