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
    packing: tuple[int, ...] = ()  # per rank: packing generation of its slot (empty: all plain)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "packing", tuple(int(g) for g in self.packing))
        except (TypeError, ValueError) as e:
            raise StoreError(f"malformed version record: packing {self.packing!r}: {e}") from None

    @classmethod
    def read(cls, store: Store, keys: Keys, token: bytes | None) -> VersionRecord | None:
        raw = store.get(keys.version)
        if raw is None:
            return None
        d = open_sealed(token, keys.version, raw)
        try:
            return cls(**d)
        except TypeError as e:
            raise StoreError(f"malformed version record: {e}") from None

    def write(self, store: Store, keys: Keys, token: bytes | None) -> None:
        store.set(keys.version, seal(token, keys.version, self.__dict__))
