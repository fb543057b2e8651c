"""What a loader needs from a source of fixed-size token windows."""

from typing import Protocol

import numpy as np


class WindowDataset(Protocol):
    """What the loader needs from a source: a count of windows and each window's tokens."""

    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray: ...
