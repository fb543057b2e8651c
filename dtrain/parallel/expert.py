"""Expert parallel: each MoE layer's experts are split over the ``ep`` mesh, and tokens travel to
their experts' ranks and back with all-to-all.

How the module is transformed: every MoE's ``experts`` (a ``GroupedExperts``) gets its
``[n_experts, ...]`` weights sharded on dim 0 over ``ep`` (DTensor ``Shard(0)``: rank r holds
experts ``r * E/ep ... (r + 1) * E/ep - 1``, and checkpoints see the whole tensors) and hooks
around its forward. FSDP then shards each expert's weights over the data ranks outside ep
(``dtrain.parallel.fsdp``).

The communication it needs, per MoE layer and forward: the model hands the experts module this
rank's token copies sorted by (global) expert and the count per expert. The input hook
1. exchanges the counts (all_to_all of ``[ep, E/ep]`` integers) and reads them on the host: the
   one device-to-host sync per layer that variable-size all-to-all needs for its split sizes;
2. sends each rank the rows of its experts (``all_to_all_single`` with variable splits) and
   orders the received rows by local expert (source rank within each), so the grouped GEMM sees
   contiguous groups. The output hook undoes the order and sends the results back.
Both all-to-alls are autograd functions whose backward is the reverse all-to-all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from dtrain.config import ConfigError
from dtrain.hooks import StepHook
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.models.moe import GroupedExperts, MoE


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits on dim 0; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def check_ep(args: LlamaArgs, ep: int) -> None:
    """Raises ConfigError when the model ``args`` describes has no experts to split or they do
    not divide over ``ep``."""
    n_experts = args.n_experts
    if not n_experts:
        raise ConfigError(f"parallel.ep = {ep} needs a mixture-of-experts model: pick an MoE "
                          "preset (mixtral_debug, mixtral_8x7b, ...) or set parallel.ep = 1")
    if n_experts % ep:
        raise ConfigError(f"parallel.ep = {ep} does not divide the model's {n_experts} experts: "
                          f"use an expert-parallel degree that divides {n_experts}")


class _Dispatch:
    """The hooks of one experts module, holding what the output hook needs from the input."""

    def __init__(self, mesh: DeviceMesh):
        self.group, self.ep = mesh.get_group(), mesh.size()

    def dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, counts = inputs
        local = counts.numel() // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank, local e]
        host = torch.stack([counts.view(self.ep, local).sum(1), received.view(self.ep, local)
                            .sum(1)]).tolist()  # the host sync
        self.send, self.recv, self.rows = host[0], host[1], x.shape[0]
        x = AllToAll.apply(x[:sum(self.send)], self.recv, self.send, self.group)
        # Received rows come grouped by (source rank, local expert); order them by
        # (local expert, source rank).
        source = torch.arange(self.ep, device=x.device).unsqueeze(1)
        segment_key = torch.arange(local, device=x.device).unsqueeze(0) * self.ep + source
        key = torch.repeat_interleave(segment_key.flatten(), received, output_size=x.shape[0])
        self.order = torch.argsort(key, stable=True)
        return x[self.order], received.view(self.ep, local).sum(0)

    def combine(self, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        unsorted = torch.empty_like(out).index_copy(0, self.order, out)
        back = AllToAll.apply(unsorted, self.send, self.recv, self.group)
        return F.pad(back, (0, 0, 0, self.rows - back.shape[0]))  # rows past capacity: zero


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(param_name, nn.Parameter(
            distribute_tensor(param, mesh, [Shard(0)])))


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Splits the experts of every MoE layer of ``model`` over ``ep_mesh`` (in place)."""
    for module in model.modules():
        if isinstance(module, MoE):
            assert isinstance(module.experts, GroupedExperts)
            hooks = _Dispatch(ep_mesh)
            distribute_module(module.experts, ep_mesh, _shard_experts,
                              input_fn=hooks.dispatch, output_fn=hooks.combine)


def split_moe_losses(model: nn.Module, group: dist.ProcessGroup, cp: int) -> None:
    """The MoE layers of ``model`` see a share of each micro-batch's tokens, the rest being on
    the other ranks of ``group`` (sequence parallel over tp, context parallel over cp): their
    load-balancing losses count the experts' tokens over all of them (``MoE.sum_over_shards``),
    as one process does. FSDP averages the gradients over the ``cp`` ranks, where a micro-batch's
    shards are to be summed: their aux losses' gradients are scaled up by ``cp``, as the LM
    loss's are (``dtrain.run``)."""
    size = dist.get_world_size(group)

    def sum_over_shards(counts: torch.Tensor) -> tuple[torch.Tensor, int]:
        total = counts.clone()
        dist.all_reduce(total, group=group)
        return total, size

    for module in model.modules():
        if isinstance(module, MoE):
            module.sum_over_shards = sum_over_shards
            module.aux_grad_scale *= cp


def moe_layers(parts: list[nn.Module]) -> dict[int, MoE]:
    """The MoE modules of this rank's model parts by layer index (blocks with a dense
    feed-forward, ``LlamaArgs.moe_layers``, have none); multi-token prediction depth k's block
    is layer ``n_layers + k``."""
    from dtrain.models.llama import canonical_name

    layers = {}
    for part in parts:
        for name, m in part.named_modules():
            if isinstance(m, MoE):
                root, index = canonical_name(name).split(".")[:2]
                layers[int(index) + (part.args.n_layers if root == "mtp" else 0)] = m
    return layers


def reset_moe_stats(layers: dict[int, MoE]) -> None:
    for moe in layers.values():
        moe.reset_stats()


def gather_moe_stats(layers: dict[int, MoE], n_layers: int, n_experts: int,
                     groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """Every layer's ``MoE.stats()`` (tokens per expert, aux and z-loss sums, forwards), summed
    over ``groups`` (the ranks that see different tokens, and the pipeline stages): a
    ``[n_layers, n_experts + 3]`` tensor, zero rows for dense layers. ``layers``: this rank's
    MoE modules (``moe_layers``)."""
    device = next(iter(layers.values())).tokens_per_expert.device if layers else "cpu"
    table = torch.zeros(n_layers, n_experts + 3, device=device)
    for i, moe in layers.items():
        table[i] = moe.stats()
    for group in groups:
        dist.all_reduce(table, group=group)
    return table


def moe_record(table: torch.Tensor) -> dict[str, float | list[float]]:
    """Metrics from ``gather_moe_stats``: mean aux and z-loss per layer and forward, and per
    layer the tokens routed to each expert per forward (one micro-batch on one rank; a mean, so
    activation recomputation, which repeats forwards, does not change it) and the load
    imbalance (busiest expert's tokens / mean)."""
    layers = (table[:, -1] > 0).nonzero().flatten().tolist()
    table = table[layers].cpu()
    counts, sums, forwards = table[:, :-3], table[:, -3:-1], table[:, -1:]
    means = (sums / forwards).mean(0)
    counts = counts / forwards
    imbalance = counts.max(1).values / counts.mean(1).clamp(min=1e-9)
    record: dict[str, float | list[float]] = {
        "aux_loss": means[0].item(), "z_loss": means[1].item(),
        "moe_load_imbalance": imbalance.max().item()}
    for i, layer in enumerate(layers):
        record[f"moe/layer{layer}/load_imbalance"] = imbalance[i].item()
        record[f"moe/layer{layer}/tokens_per_expert"] = counts[i].tolist()
    return record


def update_expert_bias(layers: dict[int, MoE], table: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing step for sigmoid routers, from the step's global token counts
    (``gather_moe_stats``)."""
    for i, moe in layers.items():
        if moe.router.score == "sigmoid":
            moe.update_expert_bias(table[i, :-3], rate)


class MoEStats(StepHook):
    """The MoE layers' step statistics, for the log and the sigmoid routers' expert bias. The
    counts are cleared before each step; after each update the expert bias of sigmoid routers
    moves by ``bias_rate`` towards balance (``update_expert_bias``, from the step's counts over
    ``groups``); each logged step's record gets ``moe_record``."""

    def __init__(self, layers: dict[int, MoE], n_layers: int, n_experts: int,
                 groups: list[dist.ProcessGroup], bias_rate: float):
        self.layers, self.n_layers, self.n_experts = layers, n_layers, n_experts
        self.groups, self.bias_rate = groups, bias_rate
        self.sigmoid = any(moe.router.score == "sigmoid" for moe in layers.values())

    def stats(self) -> torch.Tensor:
        return gather_moe_stats(self.layers, self.n_layers, self.n_experts, self.groups)

    def before_step(self) -> None:
        reset_moe_stats(self.layers)

    def after_update(self) -> None:
        if self.sigmoid:
            update_expert_bias(self.layers, self.stats(), self.bias_rate)

    def record(self, step: int) -> dict:
        return moe_record(self.stats())

