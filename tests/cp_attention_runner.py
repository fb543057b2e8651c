"""Run under torchrun by test_cp_parity.py: context-parallel attention of each comm type against
causal attention of the whole sequence on one process, forward and backward, in two cases:
``gqa``, grouped-query heads in float64 with the default softmax scale, against Llama's
``causal_attention``; ``mla``, multi-head latent attention's shapes in float32 (query/key width
24, value width 16, a softmax scale other than 1 / sqrt(24)), against ``latent_causal_attention``.
Writes, from rank 0, per case and comm type, the largest relative error of each output and
gradient, the result of ``torch.library.opcheck`` on each operator (schema, fake tensors for the
compiler, autograd registration, AOT dispatch), and how often the operator runs again in
backward under full and under selective (op) activation checkpointing.

    torchrun --nproc_per_node=N tests/cp_attention_runner.py OUT.json
"""

import json
import os
import sys
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dtrain.models.llama import causal_attention
from dtrain.models.mla import latent_causal_attention
from dtrain.parallel.activation_checkpoint import op_context
from dtrain.parallel.context import (
    COMM_TYPES,
    CP_ATTENTION_OPS,
    CP_OPS,
    ContextParallelAttention,
    load_balanced_positions,
)


class CountOps(TorchDispatchMode):
    """Counts the context-parallel attention operators that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in CP_ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def recomputed(attention, local, dout, context_fn) -> int:
    """Times the attention operator runs during backward of a checkpointed call."""
    inputs = [t.detach().requires_grad_() for t in local]
    out = checkpoint(attention, *inputs, use_reentrant=False, context_fn=context_fn)
    with CountOps() as counter:
        out.backward(dout)
    return counter.count


# case -> (dtype, heads, KV heads, query/key width, value width, softmax scale; None: default)
CASES = {"gqa": (torch.float64, 8, 4, 16, 16, None),
         "mla": (torch.float32, 4, 4, 24, 16, 0.45)}


def compare(mesh, case: str) -> dict:
    """For each comm type: the errors against one process, opcheck's results and the
    recomputation counts."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    dtype, heads, kv_heads, qk_width, v_width, scale = CASES[case]
    batch, seq = 2, 256
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, h, d, generator=gen, dtype=dtype)
                     for h, d in ((heads, qk_width), (kv_heads, qk_width), (kv_heads, v_width),
                                  (heads, v_width)))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if scale is None:
        expected = causal_attention(*full, backends=[])
    else:
        expected = latent_causal_attention(*full, backends=[], scale=scale)
    expected.backward(dout)
    index = load_balanced_positions(seq, cp, rank)
    errors = {}
    for comm_type in COMM_TYPES:
        attention = ContextParallelAttention(mesh, comm_type, [], scale)
        local = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
        out = attention(*local)
        out.backward(dout[:, index])
        pairs = [("out", out, expected), *((f"d{n}", t.grad, f.grad)
                                           for n, t, f in zip("qkv", local, full, strict=True))]
        errors[comm_type] = {name: ((got - want[:, index]).abs().max()
                                    / want[:, index].abs().max()).item()
                             for name, got, want in pairs}
        inputs = [t.detach().requires_grad_() for t in local]
        op_scale = qk_width ** -0.5 if scale is None else scale
        check = torch.library.opcheck(CP_OPS[comm_type],
                                      (*inputs, attention.group_name, "math", op_scale))
        errors[comm_type]["opcheck"] = sorted(check.values())
        errors[comm_type]["recomputed"] = {
            "full": recomputed(attention, local, dout[:, index],
                               torch.utils.checkpoint.noop_context_fn),
            "op": recomputed(attention, local, dout[:, index], partial(op_context, False))}
    return errors


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    errors = {case: compare(mesh, case) for case in CASES}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
