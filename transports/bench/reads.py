"""How a client reads a served region, and what it measures (one op size at a time).

``streams`` readers run side by side, each on its own thread with its own connection (its own
transport instance, or raw engine), each over its own slice of the region. A reader's slice is cut
into slots of ``op_size`` bytes; consecutive groups of ``depth`` slots form its batches (a ring of
at most ``RING`` batches, prepared once), and it posts them in turn: a post is one ``read`` of
``depth`` ops, all in flight together, and returns when all have landed. After one untimed post per
reader, they start together and post until ``duration`` seconds have passed (the post under way
finishes) or until they went ``repeat`` times round their ring.

Figures (``SizeResult``): bandwidth is bytes over the wall time of the timed posts (first start to
last end, all readers); the peak is the best tenth of that time, each post's bytes spread evenly over
its time in flight; a read's latency is the time of the post it was in (the whole post at
``depth`` 1: one read). Bytes checked: every byte of the ring that was read is compared with the
region's pattern after the run (the destination is first filled with another byte).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import get
from ..base import ReadBatch
from ..errors import TransportError
from .memory import Buffer

RING = 64  # prepared batches per reader at most (small ops read the same bytes over again, as perftest does)
DEFAULT_DEPTH = 16
DEPTH_BYTES = 64 << 20  # the default depth keeps at most this much in flight per reader
PEAK_BINS = 10


def default_depth(op_size: int) -> int:
    """``DEFAULT_DEPTH`` reads in flight, fewer for large ops (at most ``DEPTH_BYTES`` per post)."""
    return max(1, min(DEFAULT_DEPTH, DEPTH_BYTES // op_size))


@dataclass(frozen=True)
class Pattern:
    """How one op size is read.

    - ``op_size``: bytes per read.
    - ``depth``: reads per post, all in flight together (None: ``default_depth(op_size)``).
    - ``streams``: readers side by side, each with its own connection and slice of the region.
    - ``duration``: seconds of timed posts (the last post finishes), or None with ``repeat``.
    - ``repeat``: times round each reader's ring of batches, or None with ``duration``.
    - ``check``: compare every byte read with the region's pattern after the run.
    - ``timeout``: seconds one post may take.
    """

    op_size: int
    depth: int | None = None
    streams: int = 1
    duration: float | None = 2.0
    repeat: int | None = None
    check: bool = True
    timeout: float = 120.0

    def __post_init__(self) -> None:
        if (self.duration is None) == (self.repeat is None):
            raise ValueError("a pattern runs for a duration or a number of repeats, exactly one of them")
        if self.op_size <= 0 or self.streams < 1 or (self.depth is not None and self.depth < 1):
            raise ValueError(f"op size, streams and depth must be positive: {self}")

    @property
    def reads_per_post(self) -> int:
        return self.depth or default_depth(self.op_size)


class Reader(Protocol):
    """One stream's connection to the served region (a wbridge transport or a raw engine)."""

    label: str

    def prepare(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> Any:
        """A batch of reads of ``nbytes`` each, from region offsets ``src`` to local offsets ``dst``."""

    def read(self, handle: Any, timeout: float) -> None:
        """Posts the batch and returns when every read landed, or raises."""

    def release(self, handle: Any) -> None: ...

    def close(self) -> None: ...


#: builds stream ``i``'s reader over ``nbytes`` of local memory at ``addr`` on ``device``
ReaderFactory = Callable[[int, int, int, str], Reader]


class TransportReader:
    """A wbridge transport reading the served region: one transport instance and one peer.

    - ``name``: the transport.
    - ``served``: what the server said of it: ``endpoint`` and ``descriptor`` (hex), ``options``.
    - ``addr``, ``nbytes``, ``device``: the local memory the reads land in.
    - ``token``, ``host``: the transport's token and local address.
    - ``options``: constructor keywords added to (and over) the server's.
    - ``timeout``: for connecting.
    """

    def __init__(
        self,
        name: str,
        served: dict,
        addr: int,
        nbytes: int,
        device: str,
        *,
        token: bytes,
        host: str,
        options: dict | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.label = name
        cls = get(name)
        opts = {**served.get("options", {}), **(options or {})}
        if cls.takes("streams"):
            opts.setdefault("streams", 1)  # a bench stream is one connection: --streams makes more
        self._t = cls(token=token, host=host, **opts)
        try:
            self._local = self._t.register(addr, nbytes, device=device)
            self._peer = self._t.connect(bytes.fromhex(served["endpoint"]), timeout=timeout)
        except BaseException:
            self._t.close()
            raise
        self._remote = [bytes.fromhex(served["descriptor"])]

    def prepare(self, src: np.ndarray, dst: np.ndarray, nbytes: int) -> Any:
        zeros = np.zeros(len(src), dtype=np.int64)
        batch = ReadBatch(zeros, src, zeros, dst, np.full(len(src), nbytes, dtype=np.int64))
        return self._t.prepare(self._peer, self._remote, [self._local], batch)

    def read(self, handle: Any, timeout: float) -> None:
        self._t.read(handle, timeout=timeout)

    def release(self, handle: Any) -> None:
        self._t.release(handle)

    def close(self) -> None:
        self._t.close()


@dataclass
class SizeResult:
    """The figures of one op size (see the module docstring)."""

    label: str
    op_size: int
    depth: int
    streams: int
    reads: int
    bytes: int
    seconds: float
    gbps: float
    gbps_peak: float | None  # None: not measured (iperf3)
    lat_p50_us: float | None
    lat_p99_us: float | None
    checked_bytes: int
    verified: bool | None  # None: not checked
    round_seconds: list[float] = field(default_factory=list)  # with ``repeat``: each time round the rings

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class _Stream:
    """One reader's slice and ring."""

    index: int
    lo: int  # the slice's first byte in the region (and in the destination)
    slots: int  # op-size slots in the slice
    ring: list[np.ndarray]  # each batch's slot numbers
    reader: Any = None
    handles: list = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    posts: int = 0  # untimed ones included
    error: BaseException | None = None


def _rings(slots: int, depth: int) -> list[np.ndarray]:
    n = min(RING, -(-slots // depth))
    return [np.arange(b * depth, (b + 1) * depth) % slots for b in range(n)]


def plan_streams(span: int, pattern: Pattern) -> list[tuple[int, int]]:
    """``(first byte, slots)`` of each reader's slice of ``span`` bytes; ``ValueError`` when a reader
    would get no whole op."""
    slots = span // pattern.op_size // pattern.streams
    if slots < 1:
        raise ValueError(
            f"{pattern.streams} streams of {pattern.op_size}-byte reads need {pattern.streams * pattern.op_size} "
            f"bytes; the region read has {span}"
        )
    return [(i * slots * pattern.op_size, slots) for i in range(pattern.streams)]


def _run(s: _Stream, pattern: Pattern, start: threading.Barrier, stop_at: list[float]) -> None:
    try:
        timeout = pattern.timeout
        s.reader.read(s.handles[0], timeout)  # untimed: first touches, connection warm-up
        s.posts = 1
        start.wait(timeout)
        rounds = None if pattern.repeat is None else pattern.repeat * len(s.ring)
        while True:
            t0 = time.perf_counter()
            s.reader.read(s.handles[s.posts % len(s.ring)], timeout)
            s.ends.append(time.perf_counter())
            s.starts.append(t0)
            s.posts += 1
            if rounds is not None and len(s.ends) >= rounds:
                break
            if rounds is None and s.ends[-1] >= stop_at[0]:
                break
    except BaseException as e:  # noqa: BLE001 - re-raised by measure() with the stream named
        s.error = e
        start.abort()


def peak_gbps(starts: np.ndarray, ends: np.ndarray, nbytes: np.ndarray, bins: int = PEAK_BINS) -> float:
    """The best of ``bins`` equal parts of the run, each post's bytes spread evenly over its time."""
    t0, t1 = float(starts.min()), float(ends.max())
    if t1 <= t0:
        return 0.0
    edges = np.linspace(t0, t1, bins + 1)
    dur = np.maximum(ends - starts, 1e-12)
    done = np.clip((edges[:, None] - starts[None, :]) / dur[None, :], 0.0, 1.0) @ nbytes.astype(np.float64)
    return float((np.diff(done) / np.diff(edges)).max() / 1e9)


def measure(
    make_reader: ReaderFactory, dest: Buffer, pattern: Pattern, seed: int, *, span: int | None = None
) -> SizeResult:
    """Reads ``span`` bytes of the served region (all of ``dest`` by default) as ``pattern`` says,
    into ``dest`` at the same offsets, and returns the figures; ``seed`` is the region's pattern."""
    span = dest.nbytes if span is None else span
    op, depth = pattern.op_size, pattern.reads_per_post
    streams = [
        _Stream(i, lo, slots, _rings(slots, min(depth, slots)))
        for i, (lo, slots) in enumerate(plan_streams(span, pattern))
    ]
    label = ""
    try:
        for s in streams:
            s.reader = make_reader(s.index, dest.addr + s.lo, s.slots * op, dest.device)
            label = s.reader.label
            s.handles = [s.reader.prepare(s.lo + slots * op, slots * op, op) for slots in s.ring]
            if pattern.check:
                dest.fill_byte(0xA5, s.lo, s.lo + min(s.slots, len(s.ring) * len(s.ring[0])) * op)
        start = threading.Barrier(len(streams) + 1)
        stop_at = [float("inf")]
        threads = [
            threading.Thread(
                target=_run, args=(s, pattern, start, stop_at), name=f"bench-stream-{s.index}", daemon=True
            )
            for s in streams
        ]
        for t in threads:
            t.start()
        try:
            start.wait(pattern.timeout)
            if pattern.duration is not None:
                stop_at[0] = time.perf_counter() + pattern.duration
        except threading.BrokenBarrierError:
            pass
        for t in threads:
            t.join()
        failed = [s for s in streams if s.error is not None]
        first = [s for s in failed if not isinstance(s.error, threading.BrokenBarrierError)] or failed
        if first:  # the stream that failed, not one that stopped because another did
            s = first[0]
            raise TransportError(f"bench: stream {s.index} of {label}: {s.error}") from s.error
    finally:
        for s in streams:
            if s.reader is not None:
                for h in s.handles:
                    s.reader.release(h)
                s.reader.close()
    return _figures(label, streams, dest, pattern, seed)


def _figures(label: str, streams: Sequence[_Stream], dest: Buffer, pattern: Pattern, seed: int) -> SizeResult:
    op = pattern.op_size
    starts = np.concatenate([np.asarray(s.starts) for s in streams])
    ends = np.concatenate([np.asarray(s.ends) for s in streams])
    per_post = np.concatenate([np.full(len(s.ends), len(s.ring[0]) * op) for s in streams])
    total = int(per_post.sum())
    seconds = float(ends.max() - starts.min())
    lat = (ends - starts) * 1e6
    checked, ok = 0, None
    if pattern.check:
        ok = True
        for s in streams:
            n = min(s.posts, len(s.ring)) * len(s.ring[0])  # slots of the ring batches read at least once
            hi = s.lo + min(n, s.slots) * op
            ok = dest.check(seed, s.lo, hi) and ok
            checked += hi - s.lo
    rounds = []
    for r in range(pattern.repeat or 0):
        a = min(s.starts[r * len(s.ring)] for s in streams)
        b = max(s.ends[(r + 1) * len(s.ring) - 1] for s in streams)
        rounds.append(b - a)
    return SizeResult(
        label=label,
        op_size=op,
        depth=len(streams[0].ring[0]),
        streams=len(streams),
        reads=total // op,
        bytes=total,
        seconds=seconds,
        gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
        gbps_peak=peak_gbps(starts, ends, per_post),
        lat_p50_us=float(np.percentile(lat, 50)),
        lat_p99_us=float(np.percentile(lat, 99)),
        checked_bytes=checked,
        verified=ok,
        round_seconds=rounds,
    )
