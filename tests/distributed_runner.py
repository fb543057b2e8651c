"""Run under torchrun by the parity tests: trains each configuration in a JSON spec file with the
same process group and writes, from rank 0, each run's logged records and whether its initial
weights equal the single-device model's.

    torchrun --nproc_per_node=N tests/distributed_runner.py SPEC.json OUT.json
"""

import json
import os
import sys

import torch

from dtrain import Trainer, load_config
from dtrain.model_shape import model_args_of
from dtrain.models import Transformer
from dtrain.models.llama import canonical_name


def initial_weights_match(trainer: Trainer) -> bool:
    """Gathers every parameter and compares it with the single-device build for the same seed."""
    cfg = trainer.config
    reference = Transformer(model_args_of(cfg.model))  # the [model] section's shape
    reference.init_weights(cfg.training.seed)
    expected = dict(reference.named_parameters())
    for part in trainer.model_parts:  # pipeline stages hold disjoint parts of the model
        for name, param in part.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if not torch.equal(full.detach().cpu(), expected[canonical_name(name)].detach()):
                return False
    return True


def poison_gradient(trainer: Trainer, step: int) -> None:
    """Makes this rank's first block output NaN in the forwards of step ``step`` (1-based): its
    loss and every gradient of the step are then NaN."""
    block = next(iter(trainer.model.layers.values()))
    block.register_forward_hook(
        lambda module, args, out: out * float("nan") if trainer.step == step - 1 else out)


def first_projection(model):
    """This rank's first wq module (through compile/checkpoint wrappers), if it has one."""
    return next((m for name, m in model.named_modules() if name.endswith("attention.wq")), None)


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    results = []
    for overrides in json.load(open(spec_path)):
        until = overrides.pop("_until", None)  # stop early, as a killed job would
        poison = overrides.pop("_poison", None)  # {"step": s, "rank": r}: a NaN gradient there
        recipe = overrides.pop("_recipe", "debug")  # a TOML file, or the debug recipe
        trainer = Trainer(load_config(recipe, overrides))
        if poison is not None and trainer.rank == poison["rank"]:
            poison_gradient(trainer, poison["step"])
        # After a resume the weights are the checkpoint's, not the initial ones.
        init_ok = initial_weights_match(trainer) if trainer.step == 0 else None
        dtypes = []
        probe = first_projection(trainer.model)
        if probe is not None:
            probe = probe.register_forward_hook(
                lambda m, i, o, seen=dtypes: seen.append(str(o.dtype)))
        history = trainer.train(until)
        if probe is not None:
            probe.remove()
        results.append({"overrides": overrides, "init_ok": init_ok, "history": history,
                        "compute_dtype": dtypes[0] if dtypes else None,
                        "optimizer": type(trainer.optimizer).__name__})
    if trainer.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    # Results are written. Skip interpreter and gloo teardown: with the many subgroups of
    # several meshes it has crashed (SIGSEGV) after complete runs, in torch's destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
