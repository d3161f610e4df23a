"""Options that depend on each other, grouped into one value each (as httpx's ``Timeout``).

A publisher's sync mode is a string, except the one mode that needs a bound::

    Publisher("policy", store, rank=r, world_size=n)                        # one_step_off
    Publisher("policy", store, rank=r, world_size=n, mode="sync")
    Publisher("policy", store, rank=r, world_size=n, mode=Async(max_staleness=1))

How it stages versions is one value, ``Staging`` (copies into slots: casts, packing, checksums,
deltas) or ``ZeroCopy`` (serves the live tensors; none of those)::

    Publisher(..., staging=Staging(slots=2, delta=Delta(history=4)))       # checksums are on by default
    Publisher(..., staging=ZeroCopy())
    Publisher(..., staging=Staging(checksums=False))                       # opts out of every check

A subscriber's zone and whether it relays for it are one value, ``Zone``::

    Subscriber("policy", store, zone=Zone("east", relay=True))             # a relay always stages

Each is checked when it is built: a combination that cannot work raises ``UsageError`` saying
what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _validate
from .errors import UsageError

MODES = ("sync", "one_step_off")  # the modes named by a string; the third is Async(max_staleness=k)
MAX_SLOTS = 64  # staging slots per publisher rank; a subscriber reads at most this many fences with a version record
MAX_DELTA_HISTORY = 64  # deltas kept per publisher rank (each a registered buffer of 1/4 slot)


@dataclass(frozen=True)
class Async:
    """``mode=Async(max_staleness=k)``: publish without waiting for acks, as long as every live
    subscriber holds one of the last ``k`` versions (``k >= 0``).

    - ``max_staleness``: how many versions a live subscriber may fall behind.
    """

    max_staleness: int

    def __post_init__(self) -> None:
        _validate.integer(self.max_staleness, "Async(max_staleness)")


@dataclass(frozen=True)
class Delta:
    """Delta updates: each version is also encoded as what changed since the one before, so a
    subscriber a few versions behind reads only that (``wbridge.publish.delta``). Deltas are
    verified against chunk checksums, so a staging with deltas publishes checksums.

    - ``history``: how many versions' deltas are kept (a subscriber further behind pulls in full).
    """

    history: int = 4

    def __post_init__(self) -> None:
        n = _validate.integer(self.history, "Delta(history)", minimum=1)
        if n > MAX_DELTA_HISTORY:
            raise UsageError(f"Delta(history) must be <= {MAX_DELTA_HISTORY}, got {n}")


@dataclass(frozen=True)
class Staging:
    """Versions are copied into staging slots (the trainer's stall is that copy); the default.

    - ``slots``: slots versions rotate through (a reader of slot s blocks its reuse), 1 to 64.
    - ``checksums``: publish per-chunk checksums of each version, computed after the copy (outside the
      trainer's stall): what ``verify=True``, ``Subscriber.verify()``, deltas and zone relays check
      against. ``False`` opts out of all four.
    - ``delta``: a ``Delta`` to also publish deltas (needs ``slots >= 2`` and checksums), or None.
    """

    slots: int = 2
    checksums: bool = True
    delta: Delta | None = None

    def __post_init__(self) -> None:
        n = _validate.integer(self.slots, "Staging(slots)", minimum=1)
        if n > MAX_SLOTS:
            raise UsageError(f"Staging(slots) must be <= {MAX_SLOTS}, got {n}")
        _validate.boolean(self.checksums, "Staging(checksums)")
        if self.delta is not None and not isinstance(self.delta, Delta):
            raise UsageError(f"Staging(delta) takes Delta(history=k) or None, got {self.delta!r}")
        if self.delta is not None and not self.checksums:
            raise UsageError(
                "Staging(delta=...) verifies every delta pull against the chunk checksums: "
                "drop checksums=False (checksums are on by default)"
            )
        if self.delta is not None and n < 2:
            raise UsageError(
                "Staging(delta=...) encodes each version against the previous one in the other slot: "
                f"write Staging(slots=2, delta=...) (got slots={n})"
            )


@dataclass(frozen=True)
class ZeroCopy:
    """Serves the live tensors themselves: no staging copy, one slot; a reader's pull is fenced off
    once ``publish()`` returns, so every mode waits for the acks of each version. No cast
    (``register(dtype=)``), transform, packing or delta, which all need a copy.

    - ``checksums``: publish per-chunk checksums of each version (hashed from the live tensors while
      ``publish()`` runs: zero copy has no staging copy to move them behind). ``False`` opts out of
      ``verify=True``, ``Subscriber.verify()`` and zone relays.
    """

    checksums: bool = True

    def __post_init__(self) -> None:
        _validate.boolean(self.checksums, "ZeroCopy(checksums)")

    slots = 1
    delta = None


@dataclass(frozen=True)
class Zone:
    """The zone (cluster) a subscriber runs in: it reads from the zone's relays first and from
    publishers what they lack (``wbridge.pull.zone``).

    - ``name``: the zone's name (1 to 128 characters, no ``/``: it is part of store keys).
    - ``relay``: also serve the version it holds to the zone (a relay always stages its pulls).
    """

    name: str
    relay: bool = False

    def __post_init__(self) -> None:
        _validate.zone_name(self.name, "Zone(name)")
        _validate.boolean(self.relay, "Zone(relay)")


def mode_of(mode: str | Async) -> tuple[str, int | None]:
    """``(mode name, max_staleness)`` of a ``mode=`` argument."""
    if isinstance(mode, Async):
        return "async", mode.max_staleness
    if mode == "async":
        raise UsageError("mode='async' needs a bound on staleness: write mode=Async(max_staleness=k)")
    if mode not in MODES:
        raise UsageError(f"mode must be one of {MODES} or Async(max_staleness=k), got {mode!r}")
    return mode, None


__all__ = ["Async", "Delta", "Staging", "ZeroCopy", "Zone"]
