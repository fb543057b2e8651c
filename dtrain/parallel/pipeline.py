"""Pipeline parallel: the model split into stages by layers, run by a
``torch.distributed.pipelining`` schedule chosen by name.

Each stage is the plain ``Transformer`` with the layers it does not own deleted (``ModuleDict``
keys keep their global names, so weight init and checkpoints see the same names as the whole
model) and without embeddings / final norm and output unless it is the first / last stage. A
rank holds ``virtual_stages`` stages: looped (rank r holds r, r + pp, ...) for the interleaved
schedules, or V-shaped (rank r holds r and 2 pp - 1 - r) for ZBVZeroBubble and DualPipeV. Each
stage is then parallelized like a whole model (TP, checkpointing, compile, FSDP).

Layout: by default the layers are split evenly over all stages (earlier stages take the
remainder). ``pp_layout`` gives it explicitly, like Megatron's --pipeline-model-parallel-layout:
stages separated by ``|``, each a comma list of ``E`` (embedding), ``t`` or ``t*N`` (transformer
layers) and ``L`` (final norm, output layer and loss), e.g. ``"E|t*4|t*4|L"`` gives the
embedding and the output layer stages of their own.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config import ConfigError
from dtrain.dtensor import full
from dtrain.models.llama import Transformer

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")
# Schedules that split the backward into input- and weight-gradient passes; torch runs them
# only on uncompiled stages.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage owns: embedding, a run of layers, the output layer."""
    index: int
    layers: tuple[int, ...]
    embedding: bool
    output: bool


def parse_layout(layout: str, n_layers: int, num_stages: int) -> list[StageSpec]:
    """The stages of a layout string (see the module docstring), or an even split when empty.
    Raises ConfigError when it does not describe exactly ``n_layers`` layers over
    ``num_stages`` stages with E first and L last."""
    if not layout:
        if n_layers < num_stages:
            raise ConfigError(f"the model has {n_layers} layers, fewer than the {num_stages} "
                              "pipeline stages: lower parallel.pp or pp_virtual_stages")
        base, extra = divmod(n_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
        items = [(s == 0, counts[s], s == num_stages - 1) for s in range(num_stages)]
    else:
        items = []
        for stage in layout.replace(" ", "").split("|"):
            embedding = output = False
            count = 0
            for token in filter(None, stage.split(",")):
                for part in re.findall(r"E|L|t(?:\*\d+)?", token) or [token]:
                    if part == "E":
                        embedding = True
                    elif part == "L":
                        output = True
                    elif re.fullmatch(r"t(\*\d+)?", part):
                        count += int(part[2:]) if "*" in part else 1
                    else:
                        raise ConfigError(f"parallel.pp_layout = {layout!r}: unknown item "
                                          f"{part!r}; use E, L, t or t*N, stages split by |")
            items.append((embedding, count, output))
        total = sum(c for _, c, _ in items)
        if len(items) != num_stages or total != n_layers:
            raise ConfigError(f"parallel.pp_layout = {layout!r} has {len(items)} stages and "
                              f"{total} layers; this run needs {num_stages} stages (pp x "
                              f"virtual stages) and {n_layers} layers")
        firsts = [i for i, (e, _, _) in enumerate(items) if e]
        lasts = [i for i, (_, _, o) in enumerate(items) if o]
        if firsts != [0] or lasts != [num_stages - 1]:
            raise ConfigError(f"parallel.pp_layout = {layout!r}: E must be in the first stage "
                              "only and L in the last stage only")
    specs, start = [], 0
    for index, (embedding, count, output) in enumerate(items):
        specs.append(StageSpec(index, tuple(range(start, start + count)), embedding, output))
        start += count
    return specs


def stages_of_rank(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Stage indices held by ``pp_rank``: looped, or V-shaped for the V schedules."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


def check_pipeline(schedule: str, pp: int, virtual: int, microbatches: int,
                   compiled: bool = False) -> None:
    """Raises ConfigError for a schedule that cannot run with these numbers (or, for the
    split-backward schedules, with ``compile.enabled``)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} is not a schedule: use one of "
                          f"{', '.join(SCHEDULES)}")
    if compiled and schedule in SPLIT_BACKWARD:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} splits the backward pass, which "
                          "torch's pipelining runs only on uncompiled stages: set "
                          "compile.enabled = false, or use Interleaved1F1B or 1F1B")
    if schedule in SINGLE_STAGE and virtual != 1:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} runs one stage per rank: set "
                          "parallel.pp_virtual_stages = 1, or pick an interleaved schedule")
    if schedule in V_SCHEDULES and virtual != 2:
        raise ConfigError(f"parallel.pp_schedule = {schedule!r} runs two stages per rank in a "
                          "V: set parallel.pp_virtual_stages = 2")
    if microbatches < pp:
        raise ConfigError(f"the pipeline gets {microbatches} microbatches per step, fewer than "
                          f"parallel.pp = {pp} stages: raise training.global_batch_size (the "
                          "microbatches are global batch / (micro batch x data-parallel degree))")
    if schedule not in SINGLE_STAGE and schedule not in V_SCHEDULES and microbatches % pp:
        raise ConfigError(f"{schedule} needs the microbatches ({microbatches}) to be a multiple "
                          f"of parallel.pp = {pp}: change training.global_batch_size")


def ideal_bubble(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """Idle time over useful time, per the schedules' papers: (p - 1) / (v m) for the 1F1B family
    (v = 1 for GPipe and 1F1B); a third of that for the zero-bubble schedules, which fill the
    bubble with weight-gradient work (ZB-H1's figure; the V schedules halve stage time too)."""
    bubble = (pp - 1) / (virtual * microbatches)
    return bubble / 3 if "Zero" in schedule or schedule == "DualPipeV" else bubble


def split_model(model: Transformer, specs: list[StageSpec], indices: list[int]
                ) -> list[Transformer]:
    """Copies of the (meta) ``model`` for the stages in ``indices``, each keeping its layers."""
    parts = []
    for index in indices:
        spec = specs[index]
        part = copy.deepcopy(model)
        for name in list(part.layers.keys()):
            if int(name) not in spec.layers:
                del part.layers[name]
        if not spec.embedding:
            part.tok_embeddings = None
        if not spec.output:  # the multi-token prediction depths stay with the output layer
            part.norm, part.output, part.mtp = None, None, None
        parts.append(part)
    return parts


def drop_placeholder_stats(part: nn.Module, loss_fn) -> None:
    """torch's pipelining infers each stage's shapes in its first step by running the stage once
    on placeholder inputs (uninitialised tensors), and the last stage's loss on that output: the
    statistics these runs leave (MoE token counts and aux losses, the multi-token prediction
    losses: whatever keeps them and has ``reset_stats``) are dropped when the stage's first real
    micro-batch arrives, its second forward."""
    calls = 0

    def before_forward(module: nn.Module, args) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            for holder in [*part.modules(), loss_fn]:
                if hasattr(holder, "reset_stats"):
                    holder.reset_stats()
            handle.remove()

    handle = part.register_forward_pre_hook(before_forward)


class Pipeline:
    """A schedule over this rank's stages, the pipeline's ``dtrain.step.ForwardBackward``:
    called with the step's batches, it runs the forward and backward of ``microbatches``
    microbatches and returns the summed token loss of all of them on every stage (``step``:
    of those whose last stage is here). Forwards run in ``context``."""

    def __init__(self, parts: list[Transformer], indices: list[int], num_stages: int,
                 schedule: str, microbatches: int, pp_mesh: DeviceMesh, device: torch.device,
                 loss_fn, loss_scale: float, context: Callable[[], ContextManager] = nullcontext):
        self.device, self.microbatches, self.context = device, microbatches, context
        self.loss_scale, self.schedule_name = loss_scale, schedule
        self.pp, self.virtual = pp_mesh.size(), num_stages // pp_mesh.size()
        self.group = pp_mesh.get_group()

        def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) * loss_scale

        # imported here, not at the top: torch's pipelining imports Dynamo, which a command
        # without a pipeline need not load
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            PipelineScheduleMulti,
            PipelineScheduleSingle,
            get_schedule_class,
        )

        stages = [PipelineStage(part, index, num_stages, device, group=pp_mesh.get_group())
                  for part, index in zip(parts, indices, strict=True)]
        for part in parts:
            drop_placeholder_stats(part, loss_fn)
        cls = get_schedule_class(schedule)
        # scale_grads=False: the loss is already scaled to the global batch's mean token loss.
        if issubclass(cls, PipelineScheduleSingle):
            self.schedule = cls(stages[0], microbatches, loss_fn=scaled_loss, scale_grads=False)
        else:
            assert issubclass(cls, PipelineScheduleMulti)
            self.schedule = cls(stages, microbatches, loss_fn=scaled_loss, scale_grads=False)
        self.has_first = 0 in indices
        self.has_last = num_stages - 1 in indices

    def describe(self) -> str:
        """The start-up summary's line: the schedule and its ideal bubble."""
        bubble = ideal_bubble(self.schedule_name, self.pp, self.virtual, self.microbatches)
        return (f"pipeline: {self.schedule_name}, pp {self.pp} x {self.virtual} stages per "
                f"rank, {self.microbatches} microbatches: ideal bubble {100 * bubble:.1f}% of "
                f"compute time")

    def __call__(self, batches) -> torch.Tensor:
        pairs = [batches.next() for _ in range(self.microbatches)]
        inputs, labels = (torch.cat(part) for part in zip(*pairs, strict=True))
        with self.context():
            loss_sum = self.step(inputs, labels)
        # The last stage holds the loss: sum over the stages gives it to every rank.
        dist.all_reduce(loss_sum, group=self.group)
        return loss_sum

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # one scaled loss per microbatch whose last stage is here
            total = total + full(loss)
        return total.detach() / self.loss_scale
