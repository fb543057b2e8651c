"""dtrain's console output: the ``dtrain`` logger, printed by rank 0 alone.

Messages go to standard output as they are (no prefix), so a run's console reads like a log of
steps. Every rank logs; a filter lets rank 0's records through, and those a caller marks with
``extra=ALL_RANKS`` from every rank (what one rank alone knows: its stacks, its own error).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("dtrain")
ALL_RANKS = {"all_ranks": True}


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or getattr(record, "all_ranks", False)


class _Stdout(logging.StreamHandler):
    """A handler on whatever ``sys.stdout`` is when it writes (notebooks and test runners
    replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def setup_logging(rank: int) -> None:
    """Prints the ``dtrain`` logger's INFO records and above on standard output from rank
    ``rank`` as the filter above says. Calling it again (another trainer in the same process)
    replaces the handler."""
    for handler in list(logger.handlers):
        if isinstance(handler, _Stdout):
            logger.removeHandler(handler)
    handler = _Stdout()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_RankFilter(rank))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
