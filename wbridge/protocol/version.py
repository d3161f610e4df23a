"""The version record: what ``wb/<channel>/version`` holds for the newest committed version."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StoreError
from .channel import ChannelStore
from .keys import Keys


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

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "packing", tuple(int(g) for g in self.packing))
        except (TypeError, ValueError) as e:
            raise StoreError(f"malformed version record: packing {self.packing!r}: {e}") from None

    @property
    def identity(self) -> tuple[int, int, str]:
        """What a subscriber holds a version by: its number, publisher epoch and nonce."""
        return self.v, self.epoch, self.nonce

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
        chan.write(chan.keys.version, self.__dict__)
        chan.write(chan.keys.ready(self.v), self.__dict__)
