"""The optimizer step overlapped with the next forward, one FSDP unit at a time.

After the backward, every weight update is ready to run, but the next forward needs only the
first unit's weights to start. ``OverlappedStep`` runs the step unit by unit in forward order on a
side stream and records an event after each unit; each unit's next all-gather waits for its own
event only. The updates of the later units then run while the first ones compute, instead of
the whole step holding the device between steps. The bandwidth-bound update shares the SMs with
the forward's GEMMs, which run slower beside it (docs/benchmarks.md has the measured gain and the
profile); ``compute_stream`` gives the forward and backward the higher priority, so at least
their kernels do not wait behind update kernels.

The arithmetic is the optimizer's own, unchanged: each unit's parameters are stepped by
``optimizer.step()`` over that unit alone, so every parameter gets exactly one update from the
same kernels as a whole-model step. What changes is only the order in which the device runs them.

FSDP2 makes its all-gather streams wait for the compute stream once per forward, at the root
(``FSDPModule.set_post_optim_event`` replaces that one wait). A wait per unit needs the streams
FSDP2 shares between its units (``FSDPState._comm_ctx``), which are not public API; where they are
missing (another torch version), the step runs whole on the compute stream, as without overlap.

Without FSDP (weights whole on one GPU) the units are the model's top-level modules, each
transformer block its own (``module_units``), and the compute stream itself waits for a unit's
update before the unit's forward. Step hooks that cast the weights before the step (bf16 or FP8
copies for the micro-batches, ``StepCopies``) then cast each unit's weights before its first
forward instead (``CastPerUnit``), after that wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dtrain.dtensor import local


def fsdp_units(parts: Sequence[nn.Module]) -> list[tuple[object, list[nn.Parameter]]]:
    """(FSDP state, parameters it shards) for every FSDP unit, in the order the forward first
    reaches them (module order); parameters outside any unit come under the state ``None``."""
    owned: dict[object, list[nn.Parameter]] = {}
    seen: set[int] = set()

    def walk(module: nn.Module, state: object) -> None:
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owned.setdefault(state, []).append(param)
        for child in module.children():
            walk(child, state)

    for part in parts:
        walk(part, None)
    return list(owned.items())


def module_units(parts: Sequence[nn.Module]) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, parameters) for the top-level modules of each part, each transformer block its
    own, in module order, which is the order the forward reaches them; a parameter shared with
    an earlier module (tied embeddings) stays with that one. For weights without FSDP."""
    units: list[tuple[nn.Module, list[nn.Parameter]]] = []
    seen: set[int] = set()

    def add(module: nn.Module, params) -> None:
        kept = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in kept)
        if kept:
            units.append((module, kept))

    for part in parts:
        add(part, part.parameters(recurse=False))
        for child in part.children():
            for module in child.values() if isinstance(child, nn.ModuleDict) else [child]:
                add(module, module.parameters())
    return units


def unit_groups(optimizer: torch.optim.Optimizer,
                params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The optimizer's parameter groups narrowed to ``params``: one list per group, in order."""
    chosen = {id(p) for p in params}
    return [[p for p in group["params"] if id(p) in chosen] for group in optimizer.param_groups]


@contextlib.contextmanager
def only(optimizer: torch.optim.Optimizer, groups: list[list[nn.Parameter]]) -> Iterator[None]:
    """The optimizer's parameter groups narrowed to ``groups`` (from ``unit_groups``; each group
    keeps its options), so that ``optimizer.step()`` updates those parameters alone."""
    whole = [group["params"] for group in optimizer.param_groups]
    try:
        for group, narrowed in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = narrowed
        yield
    finally:
        for group, kept in zip(optimizer.param_groups, whole, strict=True):
            group["params"] = kept


def compute_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream for the forward and backward of higher priority than ``OverlappedStep``'s (the
    lowest): where kernels of both wait for the SMs, the GPU starts the compute stream's first.
    FSDP's communication streams have the same priority. The new stream waits for the work
    already on the device's current stream."""
    stream = torch.cuda.Stream(device, priority=-1)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


class OverlappedStep:
    """``step()`` in place of ``optimizer.step()``: each FSDP unit's update on a side stream,
    each unit's next all-gather waiting for its own update (see the module docstring).
    ``wait()`` makes the compute stream wait for every update, before anything other than the
    forward reads the weights or the optimizer state (a checkpoint, a notebook)."""

    def __init__(self, optimizer: torch.optim.Optimizer, parts: Sequence[nn.Module],
                 device: torch.device,
                 after_unit: Callable[[list[nn.Parameter]], None] | None = None):
        self.optimizer = optimizer
        self.after_unit = after_unit  # e.g. the unit's FP8 scales (fp8.UnitScales)
        self.fsdp = any(isinstance(m, FSDPModule) for part in parts for m in part.modules())
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.units = [(key, kept) for key, params in
                      (fsdp_units(parts) if self.fsdp else module_units(parts))
                      if (kept := [p for p in params if id(p) in stepped])]
        if any(key is None for key, _ in self.units):
            raise ValueError("OverlappedStep: some parameters are outside every FSDP unit")
        # Each unit's share of the parameter groups, narrowed once rather than every step.
        self.groups = [unit_groups(optimizer, params) for _, params in self.units]
        self.stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None
        self.pending: dict[int, torch.cuda.Event] = {}
        if self.stream is not None and self.fsdp:
            for part in parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.register_forward_pre_hook(self.all_gather_waits, prepend=True)
        elif self.stream is not None:
            for module, _ in self.units:
                module.register_forward_pre_hook(self._compute_waits, prepend=True)

    @property
    def modules(self) -> list[nn.Module]:
        """The units' modules, without FSDP (``module_units``)."""
        return [] if self.fsdp else [module for module, _ in self.units]

    def _compute_waits(self, module: nn.Module, args) -> None:
        """Without FSDP, before the unit's forward: the compute stream waits for its update."""
        event = self.pending.pop(id(module), None)
        if event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(event)

    def all_gather_waits(self, module: nn.Module, args) -> None:
        """Before the unit's own pre-forward (its all-gather): its streams wait for its update."""
        state = module._get_fsdp_state()
        event = self.pending.pop(id(state), None)
        if event is not None:
            ctx = state._comm_ctx
            ctx.all_gather_copy_in_stream.wait_event(event)
            ctx.all_gather_stream.wait_event(event)

    def step(self) -> None:
        """Issues every unit's update (on the side stream on CUDA; in turn elsewhere)."""
        if self.stream is not None and not self._streams_ready():
            self.optimizer.step()
            if self.after_unit is not None:
                for _, params in self.units:
                    self.after_unit(params)
            return
        on_side = contextlib.nullcontext()
        if self.stream is not None:
            # The clipped gradients and the gradient scale come from the compute stream.
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            on_side = torch.cuda.stream(self.stream)
        with on_side:
            for (key, params), groups in zip(self.units, self.groups, strict=True):
                with only(self.optimizer, groups):
                    self.optimizer.step()
                if self.after_unit is not None:
                    self.after_unit(params)
                if self.stream is not None:
                    self.pending[id(key)] = torch.cuda.Event()
                    self.pending[id(key)].record(self.stream)
        if self.stream is None:
            return
        # The compute stream frees the gradients (zero_grad) while this stream may still read
        # them: the allocator must not hand their memory out before it has.
        for _, params in self.units:
            for param in params:
                if param.grad is not None:
                    local(param.grad).record_stream(self.stream)
        scale = getattr(self.optimizer, "grad_scale", None)
        if isinstance(scale, torch.Tensor):
            scale.record_stream(self.stream)

    def describe(self) -> str:
        return "optimizer step overlapped with the next forward"

    def wait(self) -> None:
        """The compute stream waits for every update issued so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
            self.pending.clear()

    def _streams_ready(self) -> bool:
        """FSDP's all-gather streams exist (after the first forward) where this torch has them;
        without FSDP the compute stream is the one that waits."""
        if not self.fsdp:
            return True
        ctx = getattr(self.units[0][0], "_comm_ctx", None)
        return all(hasattr(ctx, name) for name in ("all_gather_copy_in_stream",
                                                   "all_gather_stream"))


def build_update(optimizer: torch.optim.Optimizer, parts: Sequence[nn.Module],
                 device: torch.device, overlap: bool,
                 after_unit: Callable[[list[nn.Parameter]], None] | None = None):
    """The run's weight update: with ``overlap`` (``optimizer.overlap_step`` where FSDP units,
    or whole weights of a dense model, are on the GPU) an ``OverlappedStep``, whose forward and
    backward then run on ``compute_stream`` (made the device's current stream here, on CUDA);
    else the whole ``optimizer.step()`` (``dtrain.optim.WholeStep``). Both have ``step()`` and
    ``wait()``."""
    from dtrain.optim import WholeStep

    if not overlap:
        return WholeStep(optimizer)
    if device.type == "cuda":
        torch.cuda.set_stream(compute_stream(device))
    return OverlappedStep(optimizer, parts, device, after_unit=after_unit)
