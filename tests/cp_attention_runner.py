"""Run under torchrun by test_cp_parity.py: context-parallel attention of each comm type against
causal attention of the whole sequence on one process, forward and backward, with grouped-query
heads. Writes, from rank 0, the largest relative error of each output and gradient.

    torchrun --nproc_per_node=N tests/cp_attention_runner.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtrain.models.llama import causal_attention
from dtrain.parallel.context import COMM_TYPES, ContextParallelAttention, load_balanced_positions


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    batch, seq, heads, kv_heads, head_dim = 2, 256, 8, 4, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, h, head_dim, generator=gen, dtype=torch.float64)
                     for h in (heads, kv_heads, kv_heads, heads))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = causal_attention(*full, backends=[])
    expected.backward(dout)
    index = load_balanced_positions(seq, cp, rank)
    errors = {}
    for comm_type in COMM_TYPES:
        local = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
        out = ContextParallelAttention(mesh, comm_type, [])(*local)
        out.backward(dout[:, index])
        pairs = [("out", out, expected), *((f"d{n}", t.grad, f.grad)
                                           for n, t, f in zip("qkv", local, full, strict=True))]
        errors[comm_type] = {name: ((got - want[:, index]).abs().max()
                                    / want[:, index].abs().max()).item()
                             for name, got, want in pairs}
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
