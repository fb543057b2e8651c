"""``python -m dtrain.train --recipe NAME [--section.key value ...]``: train a recipe, print its
resolved config, or dry-run one rank of it.

Under torchrun every rank runs this; the config is checked (``dtrain.checks``) before the
process group exists, so a config error is one ``error:`` line from each rank and exit code 2.
The trainer itself is ``dtrain.trainer.Trainer``.
"""

from __future__ import annotations

import argparse
import os
import sys

from dtrain.config import ConfigError, help_text, load_config
from dtrain.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, Preempted, RunStopped
from dtrain.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=_invoked_as(), add_help=False,
        description="Train a model from a recipe; any config field can be overridden with "
                    "--section.key value.")
    parser.add_argument("--recipe",
                        help="recipe name (dtrain/recipes/NAME.toml) or path to a .toml file")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="build one rank at the full world size on a fake process group "
                             "(meta weights, no GPU) and print its memory, then exit")
    parser.add_argument("--dry-run-world-size", type=int, default=0,
                        help="world size of the dry run (default: the product of the recipe's "
                             "parallel degrees; needed when dp_shard = -1)")
    parser.add_argument("--dry-run-rank", type=int, default=0, help="rank the dry run builds")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory of one GPU for the dry run, in GB (default: this "
                             "machine's GPU's; none without a GPU): a predicted peak over its "
                             "usable part is an error naming the layout the planner would choose")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per machine, for the planner's choice when the dry run's "
                             "peak is over the budget (default 8)")
    parser.add_argument("-h", "--help", action="store_true", help="show every config field")
    known, overrides = parser.parse_known_args(argv)
    if known.help:
        try:
            parser.print_help()
            print("\nconfig fields:\n" + help_text(), flush=True)
        except BrokenPipeError:  # `--help | head` closed the pipe: what it read was enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    try:
        config = load_config(known.recipe, overrides)
        if known.print_config:
            print(config.to_toml())
            return 0
        if known.dry_run:
            from dtrain.plan.dry_run import Budget, dry_run
            from dtrain.plan.over_budget import check_budget

            report = dry_run(config, known.dry_run_world_size or None, known.dry_run_rank,
                             budget=Budget.of(known.gpu_memory_gb))
            check_budget(report, config, 8 if known.gpus_per_node is None
                         else known.gpus_per_node)
            print(report.format())
            return 0
        if known.gpu_memory_gb is not None or known.gpus_per_node is not None:
            raise ConfigError("--gpu-memory-gb and --gpus-per-node are for the dry run: add "
                              "--dry-run, or leave them out (training uses the GPUs it runs on)")
        trainer = Trainer(config)
        try:
            trainer.train()
        finally:  # however the run ends, the run folder is free for the next one at once
            trainer.folder.release()
        trainer.close()
    except (ConfigError, FileNotFoundError) as e:
        # Every rank: most errors are found before the process group exists, by each rank alike;
        # a rank-local one (its data shard) is seen by that rank alone.
        _error(str(e))
        return EXIT_BAD_INPUT
    except Preempted as e:  # the trainer logged its line
        return e.exit_code
    except RunStopped as e:  # every rank stops at the same step; rank 0 says why
        if os.environ.get("RANK", "0") == "0":
            _error(str(e))
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C without checkpoints, or a second Ctrl-C
        if os.environ.get("RANK", "0") == "0":
            _error(f"interrupted (Ctrl-C): stopped at once; nothing was saved since the last "
                   f"checkpoint (exit code {EXIT_INTERRUPTED})")
        return EXIT_INTERRUPTED
    return 0


def _error(message: str) -> None:
    """``error: message`` as one write: the ranks under torchrun share one pipe, and a line
    written in pieces interleaves with another rank's."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def _invoked_as() -> str:
    """The command as the user typed it: ``dtrain-train`` (the installed script) or
    ``python -m dtrain.train``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") and name != "-c" else \
        "python -m dtrain.train"


if __name__ == "__main__":
    sys.exit(main())
