"""What every section's fields are made of: the configuration error, and ranged fields."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A user's configuration mistake. The message names the key, the value and the fix."""


def ranged(default: Any, ok: Callable[[Any], bool], allowed: str) -> Any:
    """A dataclass field whose values must satisfy ``ok``; ``allowed`` says which values are, in
    the error message (``load.check_ranges``). A list default is copied for each instance."""
    meta = {"range": (ok, allowed)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def unset_or(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``ok`` for a field whose unset value (None: the preset's) is allowed too."""
    return lambda v: v is None or ok(v)


def finite(value: Any) -> bool:
    """Whether every number in ``value`` (a number or a list of them) is finite."""
    values = value if isinstance(value, list) else [value]
    return all(math.isfinite(v) for v in values if isinstance(v, float))
