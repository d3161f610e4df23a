"""The version record: what ``wb/<channel>/version`` holds for the newest committed version."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StoreError
from ..store import Store
from .keys import Keys
from .records import open_sealed, seal


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

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "packing", tuple(int(g) for g in self.packing))
        except (TypeError, ValueError) as e:
            raise StoreError(f"malformed version record: packing {self.packing!r}: {e}") from None

    @classmethod
    def read(cls, store: Store, keys: Keys, token: bytes | None) -> VersionRecord | None:
        return cls.parse(keys, token, store.get(keys.version))

    @staticmethod
    def keys_with_fence(keys: Keys, nslots: int) -> list[str]:
        """What ``read_with_fence`` reads: the record and the fences of slots ``0 .. nslots - 1``."""
        return [keys.version] + [keys.fence(i) for i in range(nslots)]

    @classmethod
    def read_with_fence(
        cls, store: Store, keys: Keys, token: bytes | None, nslots: int, values: list | None = None
    ) -> tuple[VersionRecord | None, int]:
        """The record and the current fence of its slot (0 when there is no record), in one
        batched read of ``keys_with_fence`` (another read if its slot is not among them);
        ``values``: those keys' values, read already in a batch of the caller's."""
        if values is None:
            values = store.get_many(cls.keys_with_fence(keys, nslots))
        rec = cls.parse(keys, token, values[0])
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
    def parse(cls, keys: Keys, token: bytes | None, raw: bytes | None) -> VersionRecord | None:
        """The record from the bytes of ``keys.version`` (read by the caller, say in a batch)."""
        if raw is None:
            return None
        d = open_sealed(token, keys.version, raw)
        try:
            return cls(**d)
        except TypeError as e:
            raise StoreError(f"malformed version record: {e}") from None

    @classmethod
    def parse_ready(cls, keys: Keys, token: bytes | None, v: int, raw: bytes) -> VersionRecord:
        """The record of ``v`` from the bytes of ``keys.ready(v)``, which the commit writes with
        it: a subscriber blocked on that key has the record without reading ``keys.version``."""
        try:
            rec = cls(**open_sealed(token, keys.ready(v), raw))
        except TypeError as e:
            raise StoreError(f"malformed version record at {keys.ready(v)!r}: {e}") from None
        if rec.v != v:
            raise StoreError(f"store key {keys.ready(v)!r} holds the record of version {rec.v}")
        return rec

    def write(self, store: Store, keys: Keys, token: bytes | None) -> None:
        """Commits the version: the record, then the ``ready`` key of its version, which carries
        the record too and wakes the subscribers blocked on it."""
        store.set(keys.version, seal(token, keys.version, self.__dict__))
        store.set(keys.ready(self.v), seal(token, keys.ready(self.v), self.__dict__))
