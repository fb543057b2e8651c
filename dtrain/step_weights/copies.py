"""The base of the weights cast once per step: a step hook that sets each layer's copy for the
step before the step, or unit by unit under the overlapped step, and drops it before the update.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dtrain.hooks import StepHook


class CastPerUnit:
    """A step hook's weight casts, deferred from before the step to each unit's first forward
    of the step (``OverlappedStep`` without FSDP: the unit's update may still be running when
    the step starts; its forward pre-hook, which runs first, has made the compute stream wait
    for it). ``arm()`` before the step, ``disarm()`` before the update; ``cast(members)`` is
    called once per armed step for the ``members`` (modules) inside each unit, outside
    autocast, as a cast before the step runs."""

    def __init__(self, units: Sequence[nn.Module], members: Sequence[nn.Module],
                 cast: Callable[[list[nn.Module]], None]):
        self.cast = cast
        self.due: set[int] = set()
        wanted = {id(m) for m in members}
        self.members: dict[int, list[nn.Module]] = {}
        for unit in units:
            inside = [m for m in unit.modules() if id(m) in wanted]
            if inside:
                self.members[id(unit)] = inside
                unit.register_forward_pre_hook(self._before_forward)
        if sum(len(ms) for ms in self.members.values()) != len(wanted):
            raise ValueError("CastPerUnit: some modules are outside every unit")

    def arm(self) -> None:
        self.due = set(self.members)

    def disarm(self) -> None:
        self.due = set()

    def _before_forward(self, unit: nn.Module, args) -> None:
        if id(unit) in self.due:
            self.due.discard(id(unit))
            members = self.members[id(unit)]
            device_type = next(members[0].parameters()).device.type
            with torch.autocast(device_type, enabled=False):
                self.cast(members)


SLOT = "_step"  # the attribute of every layer kind that holds its step's copy


def step_copy(layer: nn.Module) -> object:
    """``layer``'s copy for the current step (its kind's: a linear's cast weight and gradient,
    an embedding's gradient, the experts' operands and gradients, an FP8 linear's weights);
    None outside a step, or where no step hook serves ``layer``."""
    return getattr(layer, SLOT, None)


class StepCopies(StepHook):
    """Base of the step hooks that give each of ``layers`` its step's copy of its weights (in
    ``layer._step``, which the layer's ``seam`` method, replaced on the instance by ``method``,
    reads; None outside a step): made before the step by ``cast``, or, given ``units`` (the
    overlapped step without FSDP), for each unit's layers before its first forward
    (``CastPerUnit``); dropped before the update (the values would be stale after it), or when
    the step is abandoned."""

    seam = "forward"

    def __init__(self, layers: Sequence[nn.Module], method: Callable,
                 units: Sequence[nn.Module] = ()):
        self.layers = list(layers)
        for layer in self.layers:
            setattr(layer, SLOT, None)
            setattr(layer, self.seam, types.MethodType(method, layer))
        self.per_unit = CastPerUnit(units, self.layers, self.cast) if units else None

    def cast(self, layers: Sequence[nn.Module]) -> None:
        """Sets the step's copy of each of ``layers``."""
        raise NotImplementedError


    def before_step(self) -> None:
        if self.per_unit is not None:
            self.per_unit.arm()
        else:
            self.cast(self.layers)

    def before_update(self) -> None:
        if self.per_unit is not None:
            self.per_unit.disarm()
        for layer in self.layers:
            setattr(layer, SLOT, None)

    def abandon_step(self) -> None:
        self.before_update()
