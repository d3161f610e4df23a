"""Argument checks of the public entry points: bad input is a ``UsageError`` naming the argument,
never a ``TypeError`` from deep inside, a silent truncation or a hang (a NaN timeout)."""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from typing import Any

import transports as _transports
from transports.base import check_host

from .errors import MissingExtraError, TransportError, UsageError

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


def rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """``rank`` among ``world_size`` ranks: integers, ``0 <= rank < world_size``."""
    rank = integer(rank, "rank")
    world_size = integer(world_size, "world_size", minimum=1)
    if rank >= world_size:
        raise UsageError(f"rank {rank} outside world_size {world_size}")
    return rank, world_size


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


def zone_name(value: Any, who: str) -> str:
    """A zone name, required (``zone`` takes None where a zone is optional)."""
    if value is None:
        raise UsageError(f"{who}: a zone needs a name (1 to {MAX_ZONE} characters without '/'), got None")
    zone(value, who)
    return value


def host(value: Any, who: str) -> str:
    """An address or host name peers reach: never a wildcard (``""``, ``0.0.0.0``, ``::``), which
    would listen on every interface; the tcp transport's ``bind_all=True`` is the documented way."""
    try:
        return check_host(value, who)
    except TransportError as e:
        raise UsageError(str(e)) from None


def transport_name(value: Any, what: str) -> str:
    """``"auto"`` or the name of a known transport (``transports.REGISTRY``)."""
    if not isinstance(value, str) or (value != "auto" and value not in _transports.REGISTRY):
        raise UsageError(f"{what} must be 'auto' or one of {sorted(_transports.REGISTRY)}, got {value!r:.80}")
    return value


def transport_names(value: Any, what: str) -> str | list[str]:
    """``"auto"``, a transport name, or a non-empty list of distinct transport names."""
    if isinstance(value, str):
        return transport_name(value, what)
    if not isinstance(value, (list, tuple)) or not value:
        known = sorted(_transports.REGISTRY)
        raise UsageError(f"{what} takes 'auto', a transport name or a list of them ({known}), got {value!r:.80}")
    names = [transport_name(v, what) for v in value]
    if "auto" in names or len(set(names)) < len(names):
        raise UsageError(f"{what}: a list names distinct transports ('auto' alone), got {value!r:.80}")
    return names


def transport_options(
    value: Any, what: str, used: Collection[str] | None = None, token: bytes | None = None
) -> dict[str, dict[str, Any]]:
    """``{transport name: {option: value}}``, each checked against that transport's own schema
    (``Transport.check_options``: its constructor's signature, and the options together with
    ``token``). ``used``: the transports the caller may open (None: any); options for another are
    refused, as are unknown names, keywords and values. A transport that does not import here
    cannot check its options: they pass, and naming that transport fails with ``MissingExtraError``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UsageError(f"{what} takes {{transport name: {{option: value}}}}, got {value!r:.80}")
    out = {}
    for name, options in value.items():
        if name not in _transports.REGISTRY:
            raise UsageError(f"{what}: unknown transport {name!r:.80}; known: {sorted(_transports.REGISTRY)}")
        if used is not None and name not in used:
            raise UsageError(f"{what}[{name!r}]: options for a transport this side does not open ({sorted(used)})")
        if not isinstance(options, Mapping):
            raise UsageError(f"{what}[{name!r}] takes {{option: value}}, got {options!r:.80}")
        try:
            out[name] = _transports.get(name).check_options(options, token)
        except MissingExtraError:
            out[name] = dict(options)
        except TransportError as e:
            raise UsageError(f"{what}[{name!r}]: {e}") from None
    return out


__all__ = [
    "MAX_NAME",
    "MAX_TIMEOUT",
    "MAX_ZONE",
    "boolean",
    "host",
    "integer",
    "name",
    "tensors",
    "timeout",
    "token",
    "transport_name",
    "transport_names",
    "transport_options",
    "zone",
    "zone_name",
]
