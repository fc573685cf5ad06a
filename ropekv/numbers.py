"""Type tests for numbers read from JSON, shared by every reader of configs and saved files.

``bool`` is an ``int`` subclass in Python; a config's ``true`` is never a count or a size, so these
tests refuse it. ``math.isfinite`` raises on ints too large for a float; :func:`is_finite_number`
answers False instead.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from .errors import ConfigError


def is_int(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool`` (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """``math.isfinite`` that is False for ints too large for a float instead of raising."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_number(what: str, value: Any, low: float, *, strict: bool) -> None:
    """ConfigError unless ``value`` is a finite int/float ``> low`` (``strict``) or ``>= low``."""
    if not is_real(value):
        raise ConfigError(f"{what} has the wrong type: a number is needed, got {value!r}")
    if not is_finite_number(value) or value < low or (strict and value == low):
        raise ConfigError(f"{what} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
