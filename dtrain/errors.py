"""The ways a run ends before its last step, each with its exit code (the README's "Long runs"
table): ``python -m dtrain.train`` prints the message as one line and exits with the code."""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""A config, data or checkpoint the run cannot use (``ConfigError``)."""
EXIT_NONFINITE = 3
"""Too many non-finite steps in a row (``NonFiniteStop``)."""
EXIT_HANG = 4
"""A rank made no progress for ``training.hang_timeout_s`` (``dtrain.watchdog``)."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM or SIGUSR1 after saving (``Preempted``); 75 is EX_TEMPFAIL: run again."""


class RunStopped(Exception):
    """The run stopped on purpose before its last step; ``exit_code`` says why."""
    exit_code = 1


class NonFiniteStop(RunStopped):
    exit_code = EXIT_NONFINITE


class Preempted(RunStopped):
    exit_code = EXIT_PREEMPTED
