"""The version record: what ``wb/<channel>/version`` holds for the newest committed version, and
each publisher rank's part of it (``RankPart``, at ``v/<v>/rank/<rank>``).

What a subscriber plans a version from is sealed, never defaulted: each rank writes its part (its
incarnation, the packing generation and layout hash of the slot holding ``v``) before it counts its
snapshot, and the committing rank copies every part into the version record. A part that is missing
or of another version, epoch or incarnation is a ``StoreError`` naming its key: the version is not
committed. Subscribers then check the rank records and slot layouts they plan from, and the
checksum records they verify with, against the version record (``wbridge.pull.connect``,
``protocol.checksum``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import StoreError
from .channel import ChannelStore
from .keys import Keys
from .stamps import Stamp


@dataclass(frozen=True)
class VersionRecord:
    v: int
    epoch: int
    slot: int
    fence: int
    world_size: int
    zero_copy: bool
    checksums: bool
    committed_at: float
    mode: str = "one_step_off"  # the publishers' sync mode (subscribers refuse pulls that would deadlock)
    packing: tuple[int, ...] = ()  # per rank: packing generation of its slot (empty: all plain)
    # drawn fresh by the committing rank for this version: with v and epoch, the version's identity.
    # A store that lost its history (wiped, restored from a backup, an old generation record put
    # back) can show a version number again for other bytes; never its nonce.
    nonce: str = ""
    # per rank: the publisher's incarnation (drawn at each register) and the layout hash of the slot
    # holding v (``protocol.packing.layout_hash``). A trainer restarted at the same epoch number (a
    # store that lost its history) has other incarnations: nothing of the old one matches them.
    incs: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()
    # per rank: the bytes each of its delta ring's buffers fills as of v, by ring position (empty:
    # no deltas; 0: none in that buffer). Hints, each checked against the delta's own header: a
    # reader of whole slots reads a delta in one read of that many bytes (``wbridge.pull.delta_reads``).
    deltas: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "packing", tuple(int(g) for g in self.packing))
            object.__setattr__(self, "incs", tuple(str(x) for x in self.incs))
            object.__setattr__(self, "layouts", tuple(str(x) for x in self.layouts))
            object.__setattr__(self, "deltas", tuple(extents(x) for x in self.deltas))
        except (TypeError, ValueError) as e:
            raise StoreError(f"malformed version record of version {self.v}: {e}") from None
        if any(len(x) != self.world_size for x in (self.incs, self.layouts, self.deltas) if x) or (
            self.packing and len(self.packing) != self.world_size
        ):
            raise StoreError(f"malformed version record of version {self.v}: per-rank fields of another world size")

    @property
    def identity(self) -> tuple[int, int, str]:
        """What a subscriber holds a version by: its number, publisher epoch and nonce."""
        return self.v, self.epoch, self.nonce

    @property
    def stamp(self) -> Stamp:
        """What the stamp of this version's slot says while the slot holds it."""
        return Stamp(self.v, self.epoch, self.slot)

    @classmethod
    def read(cls, chan: ChannelStore) -> VersionRecord | None:
        return cls.parse(chan, chan.store.get(chan.keys.version))

    @staticmethod
    def keys_with_fence(keys: Keys, nslots: int) -> list[str]:
        """What ``read_with_fence`` reads: the record and the fences of slots ``0 .. nslots - 1``."""
        return [keys.version] + [keys.fence(i) for i in range(nslots)]

    @classmethod
    def read_with_fence(
        cls, chan: ChannelStore, nslots: int, values: list | None = None
    ) -> tuple[VersionRecord | None, int]:
        """The record and the current fence of its slot (0 when there is no record), in one
        batched read of ``keys_with_fence`` (another read if its slot is not among them);
        ``values``: those keys' values, read already in a batch of the caller's."""
        store, keys = chan.store, chan.keys
        if values is None:
            values = store.get_many(cls.keys_with_fence(keys, nslots))
        rec = cls.parse(chan, values[0])
        if rec is None:
            return None, 0
        if rec.slot >= nslots:
            return rec, store.get_int(keys.fence(rec.slot))
        raw = values[1 + rec.slot]
        try:
            return rec, int(raw or 0)
        except ValueError:
            raise StoreError(f"store key {keys.fence(rec.slot)!r} holds {raw[:40]!r}, not an integer") from None

    @classmethod
    def parse(cls, chan: ChannelStore, raw: bytes | None) -> VersionRecord | None:
        """The record from the bytes of ``keys.version`` (read by the caller, say in a batch)."""
        if raw is None:
            return None
        d = chan.open(chan.keys.version, raw)
        try:
            return cls(**d)
        except TypeError as e:
            raise StoreError(f"malformed version record: {e}") from None

    @classmethod
    def parse_ready(cls, chan: ChannelStore, v: int, raw: bytes) -> VersionRecord:
        """The record of ``v`` from the bytes of ``keys.ready(v)``, which the commit writes with
        it: a subscriber blocked on that key has the record without reading ``keys.version``."""
        keys = chan.keys
        try:
            rec = cls(**chan.open(keys.ready(v), raw))
        except TypeError as e:
            raise StoreError(f"malformed version record at {keys.ready(v)!r}: {e}") from None
        if rec.v != v:
            raise StoreError(f"store key {keys.ready(v)!r} holds the record of version {rec.v}")
        return rec

    def write(self, chan: ChannelStore) -> None:
        """Commits the version: the record, then the ``ready`` key of its version, which carries
        the record too and wakes the subscribers blocked on it."""
        fields = {k: x for k, x in self.__dict__.items() if k != "deltas" or x}  # (none: as before deltas)
        chan.write(chan.keys.version, fields)
        chan.write(chan.keys.ready(self.v), fields)


def extents(x: object) -> tuple[int, ...]:
    """A rank's delta extents (``VersionRecord.deltas``) as ints >= 0 (ValueError where not)."""
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"delta extents {x!r} are not a list")
    out = tuple(int(n) for n in x)
    if any(n < 0 for n in out):
        raise ValueError(f"negative delta extents {out}")
    return out


@dataclass(frozen=True)
class RankPart:
    """One publisher rank's part of version ``v`` (``Keys.part``), sealed like every record.

    - ``v``, ``epoch``: the version and the registration epoch it was published in.
    - ``inc``: the rank's incarnation (a nonce drawn at each ``register()``).
    - ``gen``: the packing generation of the slot holding ``v`` (0: the plain slot).
    - ``layout``: the slot layout's hash (``protocol.packing.layout_hash``).
    - ``deltas``: the bytes each of its delta ring's buffers fills (``VersionRecord.deltas``).
    """

    v: int
    epoch: int
    inc: str
    gen: int
    layout: str
    deltas: tuple[int, ...] = ()

    def write(self, chan: ChannelStore, rank: int) -> None:
        chan.write(chan.keys.part(self.v, rank), asdict(self))

    @classmethod
    def read_all(cls, chan: ChannelStore, v: int, epoch: int, world_size: int) -> list[RankPart]:
        """Every rank's part of ``v`` (one batched read); ``StoreError`` naming the key of one
        that is missing or not of ``v`` in ``epoch``: nothing is committed from a guess."""
        keys = [chan.keys.part(v, r) for r in range(world_size)]
        parts = []
        for key, raw in zip(keys, chan.store.get_many(keys)):
            if raw is None:
                raise StoreError(f"store key {key!r} is missing: version {v} cannot be committed without it")
            d = chan.open(key, raw)
            try:
                part = cls(
                    int(d["v"]), int(d["epoch"]), str(d["inc"]), int(d["gen"]), str(d["layout"]),
                    extents(d.get("deltas", ())),
                )  # fmt: skip
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise StoreError(f"malformed rank record of version {v} at {key!r}: {e}") from None
            if (part.v, part.epoch) != (v, epoch):
                raise StoreError(
                    f"store key {key!r} holds the record of version {part.v} epoch {part.epoch}, not {v} epoch {epoch}"
                )
            parts.append(part)
        return parts
