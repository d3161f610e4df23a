"""A channel's store as one party sees it: the connection, the channel's keys, and the token.

Every party (a publisher rank, a subscriber, a relay) reads and writes the channel's records through
one ``ChannelStore``: the keys it uses live under the store generation it joined (``generation``),
and every record it writes is sealed, every record it reads opened, with the channel's token
(``records``). The three travel together, so functions take one value instead of three.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..store import Store
from .keys import Keys
from .records import open_sealed, seal


@dataclass(frozen=True)
class ChannelStore:
    """- ``store``: the connection.
    - ``keys``: the channel's keys (of a generation once joined: ``at(gen)``).
    - ``token``: the channel's shared secret (None: records are not signed)."""

    store: Store
    keys: Keys
    token: bytes | None

    def at(self, gen: str) -> ChannelStore:
        """The same channel's keys in store generation ``gen``."""
        return replace(self, keys=self.keys.at(gen))

    def read(self, key: str) -> Any | None:
        """The record at ``key``, its seal checked (None: absent)."""
        raw = self.store.get(key)
        return None if raw is None else open_sealed(self.token, key, raw)

    def open(self, key: str, raw: bytes) -> Any:
        """A record read by a batched get, its seal checked."""
        return open_sealed(self.token, key, raw)

    def write(self, key: str, payload: Any) -> None:
        """Seals ``payload`` and stores it at ``key``."""
        self.store.set(key, seal(self.token, key, payload))

    def sealed(self, key: str, payload: Any) -> bytes:
        """``payload`` sealed for ``key`` (to be written in a batch or a compare-and-set)."""
        return seal(self.token, key, payload)


__all__ = ["ChannelStore"]
