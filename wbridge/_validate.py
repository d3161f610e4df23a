"""Argument checks of the public entry points: bad input is a ``UsageError`` naming the argument,
never a ``TypeError`` from deep inside, a silent truncation or a hang (a NaN timeout)."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

from .errors import UsageError

# Longer timeouts wait "forever" (31 years); beyond threading's limit they would overflow.
MAX_TIMEOUT = 1e9


def timeout(value: Any, what: str, *, positive: bool = False) -> float:
    """A finite, non-negative (``positive``: > 0) number of seconds, capped at ``MAX_TIMEOUT``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{what} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise UsageError(f"{what} must be a finite {'positive' if positive else 'non-negative'} number, got {value!r}")
    return min(seconds, MAX_TIMEOUT)


def integer(value: Any, what: str, minimum: int = 0) -> int:
    """An integer >= ``minimum`` (a float, even 1.0, is refused rather than truncated)."""
    if isinstance(value, bool):
        raise UsageError(f"{what} must be an integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise UsageError(f"{what} must be an integer, got {value!r}") from None
    if n < minimum:
        raise UsageError(f"{what} must be >= {minimum}, got {n}")
    return n


def token(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise UsageError(f"token must be str, bytes or None, got {type(value).__name__}")


def tensors(value: Any, who: str) -> Mapping:
    if not isinstance(value, Mapping) or not value:
        raise UsageError(f"{who}: register() needs a non-empty mapping name -> (tensor, declaration)")
    return value


def boolean(value: Any, what: str) -> bool:
    """A bool: ``"no"``, ``2`` or None are refused rather than read as true or false."""
    if not isinstance(value, bool):
        raise UsageError(f"{what} must be True or False, got {value!r}")
    return value


MAX_NAME = 256  # characters of a subscriber's name (recorded in the store, shown in errors)


def name(value: Any, what: str) -> str:
    """A name of 1 to ``MAX_NAME`` characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        shown = value if not isinstance(value, str) or len(value) <= 40 else f"{value[:40]}... ({len(value)} chars)"
        raise UsageError(f"{what} must be 1 to {MAX_NAME} characters, got {shown!r}")
    return value


MAX_ZONE = 128  # characters of a zone name (part of store keys)


def zone(value: Any, who: str) -> str | None:
    """A zone name (1 to ``MAX_ZONE`` characters, no ``/``: it is part of store keys) or None."""
    if value is not None and (not isinstance(value, str) or not value or "/" in value or len(value) > MAX_ZONE):
        shown = value if not isinstance(value, str) or len(value) <= 40 else f"{value[:40]}... ({len(value)} chars)"
        raise UsageError(f"{who}: zone must be 1 to {MAX_ZONE} characters without '/', got {shown!r}")
    return value


__all__ = ["MAX_NAME", "MAX_TIMEOUT", "MAX_ZONE", "boolean", "integer", "name", "tensors", "timeout", "token", "zone"]
