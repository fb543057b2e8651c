"""Trains the 2-block debug model with emulated FP8 (torchao tensorwise) for a few steps on a
fixed global batch; under torchrun with FSDP over every rank and FP8 all-gather, with the
optimizer step and the scales taken whole and then unit by unit (dtrain.parallel.overlap), and
with the output layer in FP8 too. Used
by tests/test_fp8.py, in process for one device and as

    torchrun --nproc_per_node=2 tests/fp8_runner.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtrain.config import FP8Config
from dtrain.models import build
from dtrain.parallel.fp8 import UnitScales, convert_to_fp8, precompute_fp8_scales
from dtrain.parallel.fsdp import apply_fsdp
from dtrain.parallel.overlap import OverlappedStep

STEPS, BATCH, SEQ = 4, 4, 32


def train(fp8: bool = True, unitwise: bool = False,
          output_fp8: bool = False) -> tuple[list[float], bool]:
    """Per-step mean token losses over the global batch, and whether FP8 all-gather scales were
    precomputed on every converted weight (False without FSDP). ``unitwise``: the step and the
    scales one FSDP unit at a time (OverlappedStep with UnitScales). ``output_fp8``: the output
    layer converted as well (``fp8.filter_fqns = []``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build("llama3_debug", device="meta", n_layers=2)
    if fp8:
        config = FP8Config(enabled=True, emulate=True,
                           **({"filter_fqns": []} if output_fp8 else {}))
        convert_to_fp8(model, config, fsdp=world > 1)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        apply_fsdp(model, init_device_mesh("cpu", (world,)), torch.float32, torch.float32)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    stepper = OverlappedStep(optimizer, [model], torch.device("cpu"),
                             after_unit=UnitScales([model], dist.new_group())) if unitwise else None
    tokens = torch.randint(0, 4096, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    local = tokens.chunk(world)[rank]
    losses, precomputed = [], False
    for _ in range(STEPS):
        loss = F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten())
        loss.backward()  # FSDP averages the gradients: the gradient of the global mean
        if stepper is not None:
            stepper.step()
        else:
            optimizer.step()
        optimizer.zero_grad()
        if world > 1 and fp8:
            if stepper is None:
                precompute_fp8_scales([model])
            precomputed = all(p._local_tensor._precomputed_scale is not None
                              for name, p in model.named_parameters()
                              if ("layers" in name or output_fp8 and name == "output.weight")
                              and "norm" not in name)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss = loss / world
        losses.append(loss.item())
    return losses, precomputed


if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = [train(), train(unitwise=True), train(output_fp8=True)]
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
