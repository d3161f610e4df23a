"""Registering a rank's tensors: what ``Publisher.register()`` runs, in order.

0. ``serve``: the transports a rank serves every registration through, opened once (by the
   publisher's constructor).
1. ``check``: the arguments (tensors, ``dtype``, ``transforms``, ``metadata``), refused with a
   ``UsageError`` before anything is built.
2. ``build``: lays the live tensors out (``_tensors.build_layout``; ``register(dtype=)`` casts,
   ``transforms`` FP8-blocks), places the slots where the served transports reach them
   (``_selection.publisher_placement``), allocates them with their stamps and registers them with
   each served transport (``staging.build_registration``: buffers of the same size are reused) and,
   with deltas, the ring of delta buffers (``delta.build_ring``).
3. ``announce``: joins the store's generation (``protocol.generation``), makes the slot packer for
   its readers (``packing.SlotPacker``), counts the rank's epoch (``Epochs.count``) and writes the
   rank's sealed record (``staging.served_record``) and, on rank 0, the channel metadata
   (``protocol.meta``). The publisher swaps the new registration in only once both succeeded: the
   old one stays intact if anything fails.
4. ``Epochs.collect``: deletes the rank's records of the epochs two and more before the new one.

Epochs. Each ``register()`` of each rank adds one to its store generation's registration counter
(``Keys.reg``): the ``world_size`` ranks registering together share the epoch
``(count - 1) // world_size + 1``. A ``register()`` that counted and then failed (a store write,
say) is retried in the same epoch: a rank is counted once per epoch (``Epochs.pending``).
Subscribers plan against the epoch of the version they read, at worst the one before, so the
records of older epochs (rank record, packed slot layouts) are deleted, best effort: a later
registration tries again.

The stages get a ``Registrar`` (the rank's served transports and what its options fix), never the
publisher.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.layout import Declaration

from .. import _validate
from .._lifecycle import quietly
from .._selection import memory_kinds, publisher_placement
from .._tensors import FLOATING, build_layout, dtype_name
from ..errors import UsageError, WBridgeError
from ..options import Delta
from ..protocol import generation as _generation
from ..protocol import meta as _meta
from ..protocol.channel import ChannelStore
from ..protocol.version import VersionRecord
from . import transforms as _transforms
from .delta import build_ring
from .packing import SlotPacker
from .staging import Registration, build_registration, casts, release_regions, served_record, staging_buffer


@dataclass(frozen=True)
class Registrar:
    """What the register stages of one publisher rank need.

    - ``rank``, ``world_size``: this rank among the channel's publisher ranks.
    - ``zone``: the zone recorded in its record (None: none).
    - ``transports``: the transports it serves, by name (a registration is served by those that
      reach its slots).
    - ``auto``: ``transport="auto"``: device tensors are served by the transports that reach them,
      where any does (``_selection.publisher_placement``).
    - ``zero_copy``: serves the live tensors (``ZeroCopy``).
    - ``nslots``: staging slots versions rotate through.
    - ``delta``: ``Staging(delta=...)``'s ``Delta``, or None.
    """

    rank: int
    world_size: int
    zone: str | None
    transports: Mapping[str, Any]
    auto: bool
    zero_copy: bool
    nslots: int
    delta: Delta | None

    @property
    def who(self) -> str:
        return f"publisher rank {self.rank}"


def serve(
    classes: Mapping[str, type],
    options: Mapping[str, Mapping[str, Any]],
    token: bytes | None,
    host: str,
    who: str,
    asked: Any,
) -> dict[str, Any]:
    """The transports a rank serves its registrations through, opened once (``options``: each one's
    constructor keywords, checked); those opened are closed again if one fails. ``UsageError``
    where there are none (``asked``: the ``transport=`` argument)."""
    opened: dict[str, Any] = {}
    try:
        for name, cls in classes.items():
            opened[name] = cls(token=token, host=host, **options.get(name, {}))
    except BaseException:
        for t in opened.values():
            quietly(t.close)
        raise
    if not opened:
        raise UsageError(f"{who}: no transport to serve (asked for {asked!r})")
    return opened


def check(
    r: Registrar, tensors: Mapping[str, tuple[Any, Declaration]], dtype: Any, transforms: Any, metadata: Any
) -> tuple[str | None, dict, dict | None]:
    """``register()``'s arguments checked: the dtype floating tensors are published in (None: their
    own), the transforms by name, and the metadata."""
    _validate.tensors(tensors, r.who)
    transforms = _transforms.check(transforms, tensors, r.who, r.zero_copy)
    meta = _meta.check(metadata, r.who)
    cast = None if dtype is None else dtype_name(dtype)
    if cast is not None:
        if cast not in FLOATING:
            raise UsageError(f"{r.who}: dtype must be one of {FLOATING}, got {dtype!r}")
        if r.zero_copy:
            raise UsageError(
                f"{r.who}: register(dtype={cast}) casts at snapshot time, but staging=ZeroCopy() "
                "serves the live tensors as they are; use staging=Staging() to cast"
            )
    return cast, transforms, meta


def build(
    r: Registrar,
    tensors: Mapping[str, tuple[Any, Declaration]],
    cast: str | None,
    transforms: dict,
    meta: dict | None,
    old: Registration | None,
) -> Registration:
    """The new registration of ``tensors``: laid out, placed, its slots (``old``'s where they fit)
    registered with the transports that serve them, and its delta ring."""
    layout, live, device = build_layout(
        r.rank, tensors, pack=not r.zero_copy, who=r.who, cast=cast, transforms=transforms
    )
    kinds = memory_kinds(list(r.transports))
    where = publisher_placement(device, kinds, auto=r.auto, zero_copy=r.zero_copy, who=r.who)
    served = {name: r.transports[name] for name in where.served}
    reg = build_registration(
        served, layout, live, dict(tensors), device, old, transforms, r.nslots, r.zero_copy, where.device
    )
    reg.cast, reg.meta = cast, meta
    if r.delta is not None:
        try:
            size = int(reg.slots[0][0].numel()) if layout.region_sizes else 0
            reg.delta = build_ring(served, size, r.delta.history, old and old.delta, staging_buffer)
        except BaseException:
            release_regions(reg, r.transports)
            raise
    return reg


def announce(
    r: Registrar, base: ChannelStore, reg: Registration, epochs: Epochs
) -> tuple[str, ChannelStore, VersionRecord | None]:
    """Puts ``reg`` in the store's current generation (``base``: the channel without one): its
    packer, epoch and records. Returns the generation, the channel in it and its newest version
    record; ``reg``'s regions are released if anything fails."""
    try:
        gen = _generation.join(base)
        chan = base.at(gen)
        # packs slots for the readers of this generation; the packed copy moves bytes as they
        # are, so a registration that casts (register(dtype=, transforms=)) keeps the plain layout
        if not r.zero_copy and not casts(reg.layout, reg.tensors):
            reg.packer = SlotPacker(chan, reg.layout, int(reg.slots[0][0].numel()))
        reg.epoch = epochs.count(chan, gen)
        latest = VersionRecord.read(chan)
        served = {name: r.transports[name] for name in reg.served}
        record = {**served_record(reg, served, r.rank, r.world_size, r.nslots), "zone": r.zone}
        chan.write(chan.keys.rank(reg.epoch, r.rank), record)
        if r.rank == 0:
            _meta.write(chan, reg.epoch, reg.meta)
    except BaseException:
        release_regions(reg, r.transports)
        raise
    epochs.counted()
    return gen, chan, latest


@dataclass
class Epochs:
    """One publisher rank's epoch bookkeeping.

    - ``rank``, ``world_size``: the rank among the channel's publisher ranks.
    """

    rank: int
    world_size: int
    pending: tuple[str, int] | None = None  # (generation, epoch) counted by a register() that failed later
    old: list[tuple[int, int]] = field(default_factory=list)  # (epoch, packing generations) replaced

    def count(self, chan: ChannelStore, gen: str) -> int:
        """The epoch of a registration in store generation ``gen`` (``chan``): counted now, or the
        one a failed ``register()`` counted there already."""
        if self.pending is not None and self.pending[0] == gen:
            return self.pending[1]  # a retry: this rank was already counted
        count = chan.store.add(chan.keys.reg, 1)
        epoch = (count - 1) // self.world_size + 1
        self.pending = (gen, epoch)
        return epoch

    def counted(self) -> None:
        """The registration counted last is in place: the next one counts again."""
        self.pending = None

    def collect(self, chan: ChannelStore, old: Registration, epoch: int) -> None:
        """Deletes this rank's records of the epochs two and more before ``epoch`` (``old`` was
        replaced by a registration in ``epoch``)."""
        if old.epoch != epoch:
            self.old.append((old.epoch, old.packer.gen if old.packer is not None else 0))
        due = [(e, g) for e, g in self.old if e <= epoch - 2]
        if not due:
            return
        keys = [chan.keys.rank(e, self.rank) for e, _ in due]
        keys += [chan.keys.packed(e, self.rank, k) for e, g in due for k in range(1, g + 1)]
        try:
            chan.store.delete_many(keys)
        except WBridgeError:
            return
        self.old = [x for x in self.old if x not in due]


__all__ = ["Epochs", "Registrar", "announce", "build", "check", "serve"]
