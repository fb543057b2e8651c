"""dtrain's console output: the ``dtrain`` logger, printed by rank 0 alone.

Messages go to standard output as they are (no prefix), so a run's console reads like a log of
steps. Every rank logs; a filter lets rank 0's records through, and those a caller marks with
``extra=ALL_RANKS`` from every rank (what one rank alone knows: its stacks, its own error).
When standard output is a terminal, ``progress`` keeps a bar of the steps under the log lines.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

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
        if _bar is not None:  # the line goes above the bar, which is drawn again below it
            tqdm.write(self.format(record), file=sys.stdout)
            return
        self.stream = sys.stdout
        super().emit(record)


_bar: tqdm | None = None


class Progress:
    """A bar of the steps between log lines, on rank 0 when standard output is a terminal
    (nothing otherwise: a file or a pipe keeps only the log lines)."""

    def __init__(self, rank: int, step: int, last: int):
        global _bar
        self.bar = None
        if rank == 0 and sys.stdout.isatty() and _bar is None:
            self.bar = _bar = tqdm(total=last, initial=step, unit="step", file=sys.stdout,
                                   dynamic_ncols=True, leave=False, desc="train")

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def close(self) -> None:
        global _bar
        if self.bar is not None:
            self.bar.close()
            self.bar = _bar = None


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
