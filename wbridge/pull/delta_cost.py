"""Delta or full, by what each costs on the link: the subscriber's running costs and the choice.

Per link (the transports a session reads over, ``link``) a subscriber keeps a ``LinkCost``,
measured as it pulls: seconds per byte of a full read, the round trips of a delta pull's reads
beyond their bytes, seconds per changed pair to decode and apply, and per verified byte. Before a
delta pull it guesses both ways from what deltas per version have held so far (``before_tables``:
where the deltas look more than ``SKIP_MARGIN`` times slower it does not even read their tables),
then decides again on the exact sizes in the tables (``after_tables``; a reader of whole slots on
the sizes the version record says, before any read), and pulls in full where the deltas would be
slower or read more bytes. Its first ``PROBES`` delta pulls are probes (the first
also pays one-time costs), and one pull in ``PROBE_EVERY`` that cost chose full probes again.
Nothing here reads or writes: ``wbridge.pull.delta`` asks, and says why (``DELTA_REASONS``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

DELTA_REASONS = {
    "delta": "the pull applied deltas",
    "cost": "deltas were possible but estimated slower (or more bytes) than a full read on this link",
    "no-base": "the destination holds no whole version to apply deltas to (first pull, or one that failed)",
    "new-epoch": "the publishers registered again (or were restarted) since the version held",
    "too-far-behind": "more versions since the one held than the publishers keep deltas of",
    "publisher-no-delta": "the publishers keep no deltas (no Staging(delta=...)) over this transport",
    "no-delta": "a version since the one held has no delta (too many changes, or none to compare to)",
    "new-layout": "a delta since the one held is in another packing generation's byte order",
    "header-changed": "the ring was rewritten (for newer versions) before or while the deltas were read",
    "source-failed": "a source failed while its deltas were read (the full read fails over)",
    "malformed": "a delta's tables or streams did not make sense (or failed its digest, its header unchanged)",
    "unsupported-plan": "the plan reads one slot byte twice or from a region a delta does not cover",
    "zone": "read through the zone's relays",
}  # the values of ``PullStats.delta_reason``

ALPHA = 0.3  # weight of the newest size per version (an EWMA)
WINDOW = 8  # a running cost (seconds per unit) is the least of this many latest measurements
PROBES = 2  # delta pulls measured before any is declined by cost (the first pays one-time costs)
PROBE_EVERY = 32  # a pull in this many chosen full by cost tries the deltas again (costs drift)
SURE = 1.0  # a decline on the exact sizes by this makes the next guesses decline without the tables
SKIP_MARGIN = 2.0  # the tables are not even read where deltas were guessed this much slower (``sure``: 1)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def _least(seen: deque[float], new: float) -> float:
    """The running cost after measuring ``new``: the least of the latest ``WINDOW`` measurements.
    A busy host only ever adds time to a pull, so one slow measurement (a descheduled process, a
    first pull's one-time costs) does not turn the choice for the next ``PROBE_EVERY`` pulls, and
    a link that really got slower shows within ``WINDOW`` measurements."""
    seen.append(new)
    return min(seen)


@dataclass(frozen=True)
class Timed:
    """Bytes (or pairs) and the seconds they took."""

    amount: int
    seconds: float


@dataclass(frozen=True)
class DeltaPull:
    """What one delta pull measured: ``pairs`` changed pairs and ``nbytes`` bytes of coded streams
    over ``versions`` versions; its reads (bytes read, seconds, one-time set-up excluded); decoding
    and applying (pairs, seconds); verifying (bytes covered, seconds)."""

    pairs: int
    nbytes: int
    versions: int
    reads: Timed
    apply: Timed
    check: Timed


@dataclass
class LinkCost:
    """What pulls over one link (the transports a session reads over) have cost, measured as they
    go: the subscriber pulls deltas only where they are estimated cheaper than a full read.

    - ``full``: seconds per byte of a full read (its reads, as posted).
    - ``waits``: seconds of a delta pull's reads beyond their bytes at the ``full`` rate (round trips).
    - ``cpu``: seconds per changed pair to decode and apply it.
    - ``check``: seconds per byte of a delta pull's verification (hashing, chunks re-read).
    - ``pairs``, ``nbytes``: changed pairs and coded bytes per version the reads covered (EWMAs: to
      decide before reading tables).
    - ``declined``: pulls chosen full by cost since the last delta pull (a probe every ``PROBE_EVERY``).
    - ``sure``: the last pull was declined on the tables' exact sizes by ``SURE``: guesses are trusted as is.
    - ``probes``: delta pulls measured so far (none is declined by cost before ``PROBES``).
    - ``seen``: the latest ``WINDOW`` measurements of each cost in seconds.

    The four costs in seconds are each the least of their latest ``WINDOW`` measurements (``_least``).
    """

    full: float | None = None
    waits: float | None = None
    cpu: float | None = None
    check: float | None = None
    pairs: float | None = None
    nbytes: float | None = None
    declined: int = 0
    sure: bool = False
    probes: int = 0
    seen: dict[str, deque[float]] = field(
        default_factory=lambda: {k: deque(maxlen=WINDOW) for k in ("full", "waits", "cpu", "check")}, repr=False
    )

    def full_read(self, nbytes: int, seconds: float) -> None:
        """Records a full read of ``nbytes`` that took ``seconds``."""
        if nbytes > 0:
            self.full = _least(self.seen["full"], seconds / nbytes)

    def estimate(self, pairs: float, nbytes: float, covered: int) -> float | None:
        """Seconds a delta pull of ``pairs`` changed pairs in ``nbytes`` coded bytes would take,
        verifying ``covered`` bytes; None before any delta pull was measured."""
        if self.waits is None or self.cpu is None or self.check is None or self.full is None:
            return None
        return self.waits + nbytes * self.full + pairs * self.cpu + covered * self.check

    def delta_pull(self, m: DeltaPull) -> None:
        """Records a delta pull."""
        if self.full is not None:
            self.waits = _least(self.seen["waits"], max(0.0, m.reads.seconds - m.reads.amount * self.full))
        self.cpu = _least(self.seen["cpu"], m.apply.seconds / max(m.apply.amount, 1))
        self.check = _least(self.seen["check"], m.check.seconds / max(m.check.amount, 1))
        self.sized(m.pairs, m.nbytes, m.versions)
        self.declined, self.sure, self.probes = 0, False, self.probes + 1

    def sized(self, pairs: int, nbytes: int, versions: int) -> None:
        """Records the exact sizes of ``versions`` versions' deltas (from their tables)."""
        self.pairs = _ewma(self.pairs, pairs / max(versions, 1))
        self.nbytes = _ewma(self.nbytes, nbytes / max(versions, 1))


@dataclass(frozen=True)
class Guess:
    """The choice before any table is read: the full read's estimated seconds (None: unknown yet),
    whether this pull is a probe (taken whatever it costs), and whether it is declined already."""

    full: float | None
    probe: bool
    declined: bool


def before_tables(cost: LinkCost, versions: int, full_bytes: int, verify: bool) -> Guess:
    """The choice for a pull of ``versions`` versions' deltas, where a full read is ``full_bytes``
    (verified too with ``verify``), on what ``cost`` has measured; counts a decline in ``cost``."""
    full = full_bytes * cost.full if cost.full is not None else None
    if full is not None and verify and cost.check is not None:  # a full pull verifies too
        full += full_bytes * cost.check
    probe = cost.declined >= PROBE_EVERY or cost.probes < PROBES
    if full is not None and cost.pairs is not None and cost.nbytes is not None and not probe:
        guess = cost.estimate(cost.pairs * versions, cost.nbytes * versions, full_bytes)
        if guess is not None and guess > (1.0 if cost.sure else SKIP_MARGIN) * full:
            cost.declined += 1
            return Guess(full, probe, True)
    return Guess(full, probe, False)


def after_tables(
    cost: LinkCost | None, guess: Guess | None, pairs: int, nbytes: int, reread: int, versions: int, full_bytes: int
) -> str | None:
    """``"cost"`` where the deltas whose tables say ``pairs`` changed pairs in ``nbytes`` coded
    bytes (plus ``reread`` bytes of checksum chunks read again to verify) read at least as many
    bytes as a full read of ``full_bytes``, or (``cost`` and ``guess`` given, not a probe) are
    estimated no faster; else None (pull the deltas). Records the sizes and a decline in ``cost``."""
    if nbytes + reread >= full_bytes:
        return "cost"  # more bytes than a full read
    if cost is None or guess is None or guess.full is None or guess.probe:
        return None
    est = cost.estimate(pairs, nbytes, full_bytes)
    if est is None or est < guess.full:
        return None
    cost.declined += 1
    cost.sized(pairs, nbytes, versions)  # (what the tables said)
    cost.sure = est >= SURE * guess.full  # clearly slower: the next guess needs no tables read to decline
    return "cost"


def link(session: Any) -> str:
    """The name a session's costs are kept under: the transports it reads over."""
    return "+".join(sorted({s.transport for s in session.sources}))


__all__ = ["DELTA_REASONS", "DeltaPull", "Guess", "LinkCost", "Timed", "after_tables", "before_tables", "link"]
