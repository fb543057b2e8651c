"""``compile_on_first_call``: ``torch.compile`` of a small function, built when it is first
called rather than when its module is imported.

Building a compile wrapper imports Dynamo and Inductor, about 2 s of a process's start on a CPU.
dtrain's small compiled functions (the step's FP8 casts, the attention merge, the gradient adds)
run only on CUDA tensors, so ``--help``, ``--print-config``, the planner and a config error start
without them, and a GPU run builds each at its first call. (A command that builds the model, a
run or a dry run, still imports Dynamo: torch's decompositions of the meta-device model's
initialisation do.)"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def compile_on_first_call(fn: Callable | None = None, **options) -> Callable:
    """``fn`` compiled with ``torch.compile(fn, **options)`` at its first call (a decorator,
    with or without options). Called while another function is being compiled, it runs ``fn``
    itself, which that compile traces inline (as it would the compiled wrapper)."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    built: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal built
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if built is None:
            built = torch.compile(fn, **options)
        return built(*args, **kwargs)

    return call
