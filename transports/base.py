"""The transport interface: register memory, exchange descriptors, post batches of one-sided reads.

Transports move bytes between memory regions of processes. They know nothing of layouts, plans or
versions: a read is "``nbytes`` from offset ``a`` of remote region ``i`` to offset ``b`` of local
region ``j``".

Call protocol
-------------
Serving side (a publisher rank)::

    t = TcpTransport(token=b"secret", host="10.0.0.5")
    region = t.register(addr, nbytes)           # once per buffer; region.descriptor is bytes
    endpoint = t.endpoint()                     # bytes; publish endpoint + region descriptors
    ...                                         # reads are served in the background
    t.deregister(region); t.close()             # close() is idempotent

Reading side (a subscriber)::

    t = TcpTransport(token=b"secret")
    dst = t.register(addr, nbytes)              # destination memory, once
    peer = t.connect(endpoint, timeout=30.0)    # once per remote endpoint
    prep = t.prepare(peer, [desc0, desc1], [dst], batch)   # once per plan: validates bounds
    t.read(prep, timeout=60.0)                  # every pull: post all reads, wait, or raise
    t.release(prep); t.disconnect(peer); t.close()

``batch`` indexes ``remote_regions`` and ``local_regions`` by position. ``prepare`` checks every
read against the sizes in the descriptors and the local regions and raises ``TransportError``
before anything moves; the serving side checks again and refuses reads outside a registered region.
``read`` either completes every read of the batch or raises ``TransportError`` (``AuthError`` for
a failed handshake); after an error the destination bytes of that batch are unspecified. Offsets
and sizes are checked in arithmetic that cannot wrap: no batch, however hostile, makes a reader or
a server touch memory outside a region.

Constructor options
-------------------
A transport's constructor keywords besides ``token`` and ``host`` are its options. Their schema
is the constructor's signature: each keyword's type, and its bounds as ``typing.Annotated``
metadata (``Range``, ``OneOf``). ``@checked_options`` on the constructor checks every call
against it, and ``Transport.check_options(options)`` checks a mapping of options without building
anything (wbridge does this before it opens a store or a transport).

``host`` is an address peers reach (it is bound and advertised), never a wildcard (``""``,
``0.0.0.0``, ``::``): ``check_host`` refuses those. A transport that can listen on every interface
says so with an option of its own (``tcp``: ``bind_all=True``).
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import json
import math
import numbers
import socket
import threading
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar

import numpy as np

from .errors import TransportError


@dataclass(frozen=True, eq=False, init=False)
class ReadBatch:
    """Reads from one peer, held as one read-only ``(5, n)`` ``int64`` table whose rows are the
    columns below, in this order: one allocation to check and freeze, and no column can differ in
    length from the others. Each argument is one value per read:

    src_region: index into the remote region descriptors given to ``prepare``
    src_offset: byte offset inside that remote region
    dst_region: index into the local regions given to ``prepare``
    dst_offset: byte offset inside that local region
    nbytes: bytes to read
    """

    table: np.ndarray

    def __init__(self, src_region: Any, src_offset: Any, dst_region: Any, dst_offset: Any, nbytes: Any) -> None:
        names = ("src_region", "src_offset", "dst_region", "dst_offset", "nbytes")
        cols = [_column(c, what) for c, what in zip((src_region, src_offset, dst_region, dst_offset, nbytes), names)]
        lengths = sorted({len(c) for c in cols})
        if len(lengths) > 1:
            raise TransportError(f"read batch columns differ in length: {lengths}")
        table = np.stack(cols)
        table.setflags(write=False)
        object.__setattr__(self, "table", table)

    src_region = property(lambda self: self.table[0])
    src_offset = property(lambda self: self.table[1])
    dst_region = property(lambda self: self.table[2])
    dst_offset = property(lambda self: self.table[3])
    nbytes = property(lambda self: self.table[4])

    def __len__(self) -> int:
        return self.table.shape[1]

    def __repr__(self) -> str:
        return f"ReadBatch(reads={len(self)}, bytes={self.total_bytes})"

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int, int, int]]) -> ReadBatch:
        """A batch from ``(src_region, src_offset, dst_region, dst_offset, nbytes)`` rows."""
        try:
            table = np.asarray(rows).reshape(-1, 5)
        except ValueError as e:
            raise TransportError(f"read batch rows must have 5 fields each: {e}") from None
        return cls(*table.T)


_INT64_MAX = np.iinfo(np.int64).max


def _column(values: Any, what: str) -> np.ndarray:
    """One column of a batch as ``int64``: integers, each within ``int64`` (never wrapped, never
    truncated: ``2**64 - 8`` is not ``-8``, ``1.5`` is not ``1``); integral floats are taken."""
    try:
        col = np.ravel(np.asarray(values))
        if col.dtype.kind == "O":  # Python ints beyond 64 bits, or not numbers at all
            col = np.ravel(np.asarray(values, dtype=np.int64))
    except (OverflowError, TypeError, ValueError) as e:
        raise TransportError(f"read batch {what}: not 64-bit integers ({e})") from None
    if col.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = col.dtype.kind
    if kind == "u":
        ok = bool((col <= _INT64_MAX).all())
    elif kind == "f":
        ok = bool((np.isfinite(col) & (col == np.floor(col)) & (np.abs(col) < 2.0**63)).all())
    else:
        ok = kind == "i"
    if not ok:
        raise TransportError(f"read batch {what}: values must be integers in int64, got {col.dtype} {col[:4]}")
    return col.astype(np.int64)


@dataclass(eq=False)
class Region:
    """A local registration: a handle, never sent anywhere. ``descriptor`` is what peers get."""

    id: int
    addr: int
    nbytes: int
    device: str
    descriptor: bytes
    handle: Any = field(default=None, repr=False)


@dataclass(eq=False)
class PreparedBatch:
    """What ``prepare`` returns where a transport keeps state per batch (a subclass adds what its
    ``read`` posts): the batch's peer and size, and whether it was released.

    peer: the peer the reads go to (messages name it by its ``label``; ``closed`` once disconnected)
    count: reads in the batch
    nbytes: bytes they move
    released: set once ``release`` (or the transport's ``close``) freed the batch
    """

    peer: Any
    count: int
    nbytes: int
    released: bool = field(default=False, kw_only=True)

    def check_readable(self, kind: str) -> None:
        """Raises ``TransportError`` when the batch was released or its peer disconnected."""
        if self.released or self.peer.closed:
            raise TransportError(f"{kind}: read of a released batch or closed peer {self.peer.label}")

    def __repr__(self) -> str:
        name, label = type(self).__name__, self.peer.label
        return f"{name}({label}, reads={self.count}, bytes={self.nbytes}, released={self.released})"


def encode_descriptor(kind: str, **fields: Any) -> bytes:
    return json.dumps({"transport": kind, **fields}, separators=(",", ":"), sort_keys=True).encode()


def decode_descriptor(kind: str, data: bytes, required: Sequence[str]) -> dict:
    """Parses and validates a descriptor that came from a peer (through an untrusted store)."""
    try:
        d = json.loads(bytes(data))
    except (ValueError, TypeError) as e:
        raise TransportError(f"{kind}: malformed descriptor: {e}") from None
    if not isinstance(d, dict) or d.get("transport") != kind:
        raise TransportError(
            f"{kind}: descriptor is for transport {d.get('transport') if isinstance(d, dict) else d!r}"
        )
    missing = [k for k in required if k not in d]
    if missing:
        raise TransportError(f"{kind}: descriptor lacks {missing}")
    return d


def check_batch_bounds(
    kind: str, batch: ReadBatch, remote_sizes: Sequence[int], local_sizes: Sequence[int], peer: str
) -> None:
    """Raises ``TransportError`` if any read of ``batch`` falls outside its regions.

    Overflow-safe: offsets and sizes are checked non-negative first, then each read's size against
    the room left after its offset (``size - offset``, which cannot wrap), never ``offset + nbytes``
    (which wraps past ``2**63`` in ``int64``)."""
    if len(batch) == 0:
        return
    rs = _column(remote_sizes, "remote region sizes")
    ls = _column(local_sizes, "local region sizes")
    if (rs < 0).any() or (ls < 0).any():
        raise TransportError(f"{kind}: negative region size (remote {rs.tolist()}, local {ls.tolist()})")
    bad = (
        (batch.src_region < 0)
        | (batch.src_region >= len(rs))
        | (batch.dst_region < 0)
        | (batch.dst_region >= len(ls))
        | (batch.nbytes <= 0)
        | (batch.src_offset < 0)
        | (batch.dst_offset < 0)
    )
    if not bad.any():
        bad = (batch.nbytes > rs[batch.src_region] - batch.src_offset) | (
            batch.nbytes > ls[batch.dst_region] - batch.dst_offset
        )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransportError(
            f"{kind}: read {i} to peer {peer} out of bounds: src region {int(batch.src_region[i])} "
            f"offset {int(batch.src_offset[i])} dst region {int(batch.dst_region[i])} offset "
            f"{int(batch.dst_offset[i])} nbytes {int(batch.nbytes[i])} (remote sizes {rs.tolist()}, "
            f"local sizes {ls.tolist()})"
        )


# -- addresses and constructor options -------------------------------------------------------
def is_wildcard(host: str) -> bool:
    """Whether ``host`` names every interface (``""``, ``0.0.0.0``, ``0``, ``::``, ``::ffff:0.0.0.0``)."""
    if host.strip() == "":
        return True
    try:
        if socket.inet_aton(host) == b"\0\0\0\0":  # also the short forms "0", "0.0", "0x0"
            return True
    except OSError:
        pass
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_unspecified or (mapped is not None and mapped.is_unspecified)


def check_host(host: object, kind: str = "transport") -> str:
    """``host`` as given: a non-empty address or name that peers can reach, never a wildcard
    (``TransportError`` says how to listen on every interface instead)."""
    if not isinstance(host, str) or len(host) > 255:
        raise TransportError(f"{kind}: host must be an address or host name (a string), got {host!r:.80}")
    if is_wildcard(host):
        raise TransportError(
            f"{kind}: host {host!r} is a wildcard (every interface); host is the address peers reach "
            "(bound and advertised): give that address; to listen on every interface too, the tcp "
            "transport takes bind_all=True"
        )
    return host


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric option (``Annotated`` metadata): ``low <= value <= high``, ``low``
    excluded with ``open_low``; ``None``: unbounded."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False

    def admits(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __str__(self) -> str:
        low = "" if self.low is None else f"{'>' if self.open_low else '>='} {self.low}"
        high = "" if self.high is None else f"<= {self.high}"
        return " and ".join(x for x in (low, high) if x)


@dataclass(frozen=True)
class OneOf:
    """The values an option takes (``Annotated`` metadata)."""

    values: tuple

    def admits(self, value: Any) -> bool:
        return value in self.values

    def __str__(self) -> str:
        return f"one of {self.values}"


#: Option types for constructor signatures. Seconds: finite, > 0, at most ~31 years.
Seconds = Annotated[float, Range(0.0, 1e9, open_low=True)]
#: A count or size of at least 1.
Positive = Annotated[int, Range(1)]
#: Keywords of every transport's constructor that are not options (wbridge passes them itself).
NOT_OPTIONS = frozenset({"self", "token", "host"})


@dataclass(frozen=True)
class OptionSpec:
    """One option of a transport: the types it takes (``bool`` and ``int`` apart; ``float`` takes
    ints), whether None, and its bounds."""

    types: tuple[type, ...]
    optional: bool
    bounds: tuple[Any, ...]
    default: Any

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is refused, or None."""
        if value is None:
            return None if self.optional else "must not be None"
        if isinstance(value, (bool, np.bool_)):
            ok = bool in self.types
        elif isinstance(value, numbers.Integral):  # numpy's integers too
            ok = int in self.types or float in self.types
        elif isinstance(value, numbers.Real):
            ok = float in self.types and math.isfinite(value)
        else:
            ok = isinstance(value, tuple(t for t in self.types if t not in (bool, int, float)))
        if not ok:
            names = [("a finite " if t is float else "") + t.__name__ for t in self.types]
            return f"must be {' or '.join(names + ['None'] * self.optional)}, got {value!r:.80}"
        for bound in self.bounds:
            if not bound.admits(value):
                return f"must be {bound}, got {value!r:.80}"
        return None


def _spec(hint: Any, default: Any) -> OptionSpec:
    bounds: tuple[Any, ...] = ()
    if typing.get_origin(hint) is Annotated:
        hint, *meta = typing.get_args(hint)
        bounds = tuple(m for m in meta if isinstance(m, (Range, OneOf)))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
    else:
        args = (hint,)
    kinds = tuple(a for a in args if a is not type(None))
    return OptionSpec(kinds, len(kinds) < len(args), bounds, default)


@functools.cache
def option_schema(init: Callable[..., Any]) -> Mapping[str, OptionSpec]:
    """The options of a transport constructor, from its signature (names, types, defaults) and
    annotations (``Range``, ``OneOf``)."""
    init = inspect.unwrap(init)
    hints = typing.get_type_hints(init, include_extras=True)
    out = {}
    for name, param in inspect.signature(init).parameters.items():
        if name in NOT_OPTIONS or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        out[name] = _spec(hints.get(name, Any), param.default)
    return types.MappingProxyType(out)


def check_options(kind: str, schema: Mapping[str, OptionSpec], options: object) -> dict[str, Any]:
    """``options`` (keyword -> value) checked against ``schema``; ``TransportError`` names the first
    unknown keyword or bad value."""
    if not isinstance(options, Mapping):
        raise TransportError(f"{kind}: options must be a mapping of keyword -> value, got {options!r:.80}")
    for key, value in options.items():
        spec = schema.get(key) if isinstance(key, str) else None
        if spec is None:
            reserved = " (set by the caller, not an option)" if key in NOT_OPTIONS else ""
            raise TransportError(f"{kind}: unknown option {key!r:.80}{reserved}; options: {sorted(schema)}")
        why = spec.problem(value)
        if why is not None:
            raise TransportError(f"{kind}: option {key} {why}")
    return dict(options)


def _check_all(
    cls: type[Transport], kind: str, schema: Mapping[str, OptionSpec], given: object, token: object
) -> dict[str, Any]:
    """``given`` checked option by option, then as a whole (defaults filled in) with ``token``."""
    options = check_options(kind, schema, given)
    cls.check_combination({**{k: spec.default for k, spec in schema.items()}, **options}, token)
    return options


_Init = TypeVar("_Init", bound=Callable[..., None])


def checked_options(init: _Init) -> _Init:
    """Decorates a transport's ``__init__``: ``host`` and every option passed are checked against
    its signature (``option_schema``) before the constructor runs."""

    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: Transport, *args: Any, **kwargs: Any) -> None:
        kind = getattr(type(self), "name", type(self).__name__)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError as e:  # an unknown keyword, say
            raise TransportError(f"{kind}: {e}; options: {sorted(option_schema(init))}") from None
        bound.apply_defaults()
        check_host(bound.arguments.get("host"), kind)
        given = {k: v for k, v in bound.arguments.items() if k not in NOT_OPTIONS}
        _check_all(type(self), kind, option_schema(init), given, bound.arguments.get("token"))
        init(self, *args, **kwargs)

    return typing.cast(_Init, wrapper)


class Transport(ABC):
    """Base class; see the module docstring for the call protocol.

    Constructor keywords shared by every transport: ``token`` (bytes or None) authenticates peers
    where the transport supports it, ``host`` is the address a serving side binds or advertises
    (``127.0.0.1`` by default: nothing listens on all interfaces unless asked).
    """

    name: ClassVar[str] = "base"
    #: The kinds of memory this transport registers, serves and reads into directly: ``"cpu"``
    #: (host memory), plus ``"cuda"`` where it reaches device memory without a host bounce.
    #: wbridge stages tensors that live in a kind a transport lacks in host memory
    #: (``wbridge._selection``: the publisher's slots, the subscriber's read buffer).
    memory_kinds: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(self, *, token: bytes | None = None, host: str = "127.0.0.1") -> None:
        self.token = token
        self.host = check_host(host, self.name)
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def check_options(cls, options: object, token: object = None) -> dict[str, Any]:
        """``options`` (constructor keywords, as ``transport_options`` carries them) checked against
        this transport's constructor signature, then as a whole with ``token``
        (``check_combination``), without building anything: an unknown keyword, a value of the
        wrong type or out of bounds, or options that cannot work together raise ``TransportError``
        naming them. Returns the options given."""
        return _check_all(cls, cls.name, option_schema(cls.__init__), options, token)

    @classmethod
    def takes(cls, option: str) -> bool:
        """Whether ``option`` is one of this transport's constructor options."""
        return option in option_schema(cls.__init__)

    @classmethod
    def check_combination(cls, options: Mapping[str, Any], token: object) -> None:
        """Refuses options that cannot work together or with ``token`` (each alone already checked;
        ``options`` holds every option, defaults filled in). Default: every combination works."""

    # -- serving and registration ------------------------------------------------------------
    @abstractmethod
    def register(self, addr: int, nbytes: int, *, device: str = "cpu") -> Region:
        """Registers ``nbytes`` at ``addr`` (``device`` ``cpu`` or ``cuda:N``) for local or remote use."""

    def host_buffer(self, nbytes: int) -> Any | None:
        """A writable host buffer of ``nbytes`` that this transport serves best (shared memory, say),
        for a publisher to stage into; ``None`` means any memory will do. Register it as usual."""
        return None

    @abstractmethod
    def deregister(self, region: Region) -> None:
        """Stops serving ``region``; reads of it are refused from now on."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """This process's serializable address for peers (listening address, agent metadata)."""

    # -- reading -----------------------------------------------------------------------------
    @abstractmethod
    def connect(self, endpoint: bytes, *, timeout: float) -> Any:
        """Opens a peer from its endpoint; authenticates where the transport does."""

    @abstractmethod
    def prepare(
        self, peer: Any, remote_regions: Sequence[bytes], local_regions: Sequence[Region], batch: ReadBatch
    ) -> Any:
        """Validates ``batch`` and builds whatever can be reused by every ``read``."""

    @abstractmethod
    def read(self, prepared: Any, *, timeout: float) -> None:
        """Posts every read of a prepared batch and waits for all of them, or raises."""

    def release(self, prepared: Any) -> None:
        """Frees what ``prepare`` built. Default: nothing to free."""

    def disconnect(self, peer: Any) -> None:
        """Closes a peer opened by ``connect``. Default: nothing to close."""

    @abstractmethod
    def close(self) -> None:
        """Releases everything; idempotent."""

    def _begin_close(self) -> bool:
        """Marks the transport closed; False when it already was (``close`` then has nothing to do)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _end_serving(self, peers: Sequence[Any], server: Any, regions: Sequence[Region], timeout: float) -> None:
        """The rest of ``close`` for a transport with a listener: ``peers`` disconnected, ``server``
        (if any) closed, waiting up to ``timeout`` for its connections, ``regions`` deregistered."""
        for peer in peers:
            self.disconnect(peer)
        if server is not None:
            server.close(timeout)
        for region in regions:
            self.deregister(region)

    # -- descriptors and bounds, under this transport's name ------------------------------------
    @classmethod
    def _descriptor(cls, **fields: Any) -> bytes:
        """An endpoint or region descriptor of this transport (``encode_descriptor``)."""
        return encode_descriptor(cls.name, **fields)

    @classmethod
    def _peer_descriptor(cls, data: bytes, required: Sequence[str]) -> dict:
        """A descriptor from a peer, parsed and checked to be this transport's (``decode_descriptor``)."""
        return decode_descriptor(cls.name, data, required)

    @classmethod
    def _check_bounds(
        cls, batch: ReadBatch, remote_sizes: Sequence[int], local_sizes: Sequence[int], peer: str
    ) -> None:
        """Refuses a batch with a read outside its regions (``check_batch_bounds``)."""
        check_batch_bounds(cls.name, batch, remote_sizes, local_sizes, peer)

    def _check_open(self) -> None:
        """Raises ``TransportError`` once ``close`` was called."""
        if self._closed:
            raise TransportError(f"{self.name}: transport is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(host={self.host!r}, closed={self._closed})"
