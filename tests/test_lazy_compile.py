"""``compile_on_first_call``: dtrain's small compiled functions are built at their first call,
so importing dtrain loads neither Dynamo nor Inductor (seconds of every process's start)."""

import os
import subprocess
import sys

import torch
from conftest import PYTHONPATH, ROOT

from dtrain.kernels.lazy_compile import compile_on_first_call


def test_importing_the_trainer_loads_no_compiler():
    probe = ("import sys, dtrain.train, dtrain.parallel.pipeline; "
             "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": PYTHONPATH}).stdout
    assert out.strip() == "[]"


def test_the_wrapper_is_built_once_at_the_first_call(monkeypatch):
    built = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: built.append(kw) or real(fn, **kw))

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    lazy = compile_on_first_call(scale, backend="eager", fullgraph=True)
    assert built == [] and lazy.__name__ == "scale"
    x = torch.arange(4.0)
    assert torch.equal(lazy(x), scale(x)) and torch.equal(lazy(x + 1), scale(x + 1))
    assert built == [{"backend": "eager", "fullgraph": True}]


def test_called_inside_a_compiled_function_it_is_traced_inline():
    lazy = compile_on_first_call(lambda x: x.sin(), backend="eager")

    @torch.compile(backend="eager", fullgraph=True)  # a graph break here would raise
    def outer(x):
        return lazy(x) + 1

    x = torch.linspace(0, 1, 5)
    assert torch.allclose(outer(x), x.sin() + 1)
