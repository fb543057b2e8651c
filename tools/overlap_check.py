"""Checks on the GPU that the overlapped optimizer step never lets an all-gather read a weight
before its update (dtrain.parallel.overlap).

    torchrun --nproc_per_node=2 tools/overlap_check.py --recipe llama3_1b [--no-wait] [--k v ...]

In every forward after the first, right after each FSDP unit's all-gather is issued, the
device waits for all updates and compares each gathered weight with its updated shards gathered
again (in the compute dtype, as FSDP casts them). It prints the number of weights that differ
per step: 0 is correct. The side stream first sleeps ``--delay-ms`` before each step's updates,
so that they are late for the next forward whatever the host's lead; ``--no-wait`` removes the
per-unit wait, to show that the check then sees the race it guards against.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dtrain import Trainer, load_config  # noqa: E402
from dtrain.parallel.overlap import OverlappedStep  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-wait", action="store_true",
                        help="drop the per-unit wait (the check should then find stale weights)")
    parser.add_argument("--delay-ms", type=float, default=50.0,
                        help="device sleep on the side stream before each step's updates")
    args, overrides = parser.parse_known_args()
    if args.no_wait:
        OverlappedStep.all_gather_waits = lambda self, module, inputs: self.pending.clear()
    trainer = Trainer(load_config(args.recipe, overrides + [
        "--training.steps", str(args.steps), "--metrics.tensorboard", "false"]))
    stepper = trainer.overlapped_step
    if stepper is None:
        raise SystemExit("no overlapped step in this configuration (CUDA and FSDP needed)")
    # Each unit's sharded parameters, by their place in the unit's modules.
    checks = []
    for state, params in stepper.units:
        wanted = {id(p) for p in params}
        for module in state._modules:
            for name, param in module.named_parameters():
                if id(param) in wanted:
                    checks.append((module, name, param))
    stale = []
    # The side stream sleeps before the first unit's update (optimizer.step runs on it).
    step_unit, late = stepper.optimizer.step, [False]

    def late_step(*a, **kw):
        if late[0]:
            torch.cuda._sleep(int(args.delay_ms * 1e-3 * 1.5e9))  # cycles, at about 1.5 GHz
            late[0] = False
        return step_unit(*a, **kw)

    stepper.optimizer.step = late_step

    def check(module, inputs):
        if trainer.step == 0:
            return
        torch.cuda.current_stream().wait_stream(stepper.stream)
        for owner, name, sharded in checks:
            if owner is module:
                gathered = module.get_parameter(name)
                expected = sharded.full_tensor().to(gathered.dtype)
                stale[-1] += int(not torch.equal(gathered.detach(), expected))

    for module in {owner for owner, _, _ in checks}:
        assert isinstance(module, FSDPModule)
        module.register_forward_pre_hook(check)  # after FSDP's pre-forward: gathered weights
    for step in range(args.steps):
        stale.append(0)
        late[0] = True
        # As the training loop runs it: the updates left in flight, the host running ahead
        # (no synchronisation here, which would let every update finish before the next step).
        trainer.run_step()
        if trainer.rank == 0:
            print(f"step {step + 1}: {stale[-1]} of {len(checks)} gathered weights stale",
                  flush=True)
    if trainer.rank == 0:
        print(f"OVERLAP_CHECK {'no-wait' if args.no_wait else 'wait'}: "
              f"{sum(stale)} stale weights in {args.steps} steps", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
