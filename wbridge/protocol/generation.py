"""The store generation: which incarnation of the channel's store this client is talking to.

A store that was lost and came back empty (the TCPStore host restarted, etcd's data wiped) restarts
every counter: epochs, versions and subscriber ids would begin again at 1 and collide with what
clients remember. So the first client to find a channel's store without a generation record draws
a random nonce and writes it (signed) at ``wb/<channel>/gen``; every other key of the channel lives
under that nonce (``protocol.keys``), so every record's signature covers it. A client that finds
another nonce than its own (or none) knows the store was lost: it drops what it planned and knew,
and joins the new generation.
"""

from __future__ import annotations

import os
import re

from ..errors import StoreError
from ..store import Store
from .keys import Keys
from .records import open_sealed, seal

_NONCE = re.compile(r"[0-9a-f]{32}")


def current(store: Store, keys: Keys, token: bytes | None) -> str | None:
    """The channel's generation in ``store`` (None: none yet, a fresh or wiped store)."""
    return parse(keys, token, store.get(keys.generation))


def parse(keys: Keys, token: bytes | None, raw: bytes | None) -> str | None:
    """The generation in ``raw``, a value of ``keys.generation`` read along with other keys."""
    if raw is None:
        return None
    rec = open_sealed(token, keys.generation, raw)
    nonce = rec.get("nonce") if isinstance(rec, dict) else None
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise StoreError(f"malformed generation record at store key {keys.generation!r}")
    return nonce


def join(store: Store, keys: Keys, token: bytes | None) -> str:
    """The channel's generation, created here if the store has none yet."""
    gen = current(store, keys, token)
    if gen is None:
        mine = os.urandom(16).hex()
        store.compare_set(keys.generation, None, seal(token, keys.generation, {"nonce": mine}))
        gen = current(store, keys, token)  # ours, or the one a racing client wrote first
        if gen is None:
            raise StoreError(f"store key {keys.generation!r} vanished right after it was written")
    return gen


__all__ = ["current", "join", "parse"]
