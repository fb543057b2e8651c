"""The ways a run ends before its last step, each with its exit code (the README's "Long runs"
table): ``python -m dtrain.train`` prints the message as one line and exits with the code."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""A config, data, checkpoint or run folder the run cannot use (``ConfigError``): a typo, a
missing or damaged file, a folder another run holds, a folder it cannot write."""
EXIT_NONFINITE = 3
"""Too many non-finite steps in a row (``NonFiniteStop``)."""
EXIT_HANG = 4
"""A rank made no progress within its phase's allowance (``dtrain.watchdog``)."""
EXIT_NOT_SAVED = 5
"""The run reached its last step but the checkpoint of that step could not be written (a full
or unwritable disk: ``CheckpointNotSaved``); the latest checkpoint is an earlier step."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM, SIGUSR1 or Ctrl-C after saving (``Preempted``); 75 is EX_TEMPFAIL: run
again to resume."""
EXIT_INTERRUPTED = 130
"""Ctrl-C with checkpointing off (128 + SIGINT, the shell's convention): nothing was saved."""


class RunStopped(Exception):
    """The run stopped on purpose before its last step; ``exit_code`` says why."""
    exit_code = 1


class NonFiniteStop(RunStopped):
    exit_code = EXIT_NONFINITE


class Preempted(RunStopped):
    exit_code = EXIT_PREEMPTED


class CheckpointNotSaved(RunStopped):
    exit_code = EXIT_NOT_SAVED


class Interrupted(RunStopped):
    exit_code = EXIT_INTERRUPTED
