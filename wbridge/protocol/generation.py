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
from .channel import ChannelStore

_NONCE = re.compile(r"[0-9a-f]{32}")


def current(chan: ChannelStore) -> str | None:
    """The channel's generation in its store (None: none yet, a fresh or wiped store)."""
    return parse(chan, chan.store.get(chan.keys.generation))


def parse(chan: ChannelStore, raw: bytes | None) -> str | None:
    """The generation in ``raw``, a value of ``keys.generation`` read along with other keys."""
    keys = chan.keys
    if raw is None:
        return None
    rec = chan.open(keys.generation, raw)
    nonce = rec.get("nonce") if isinstance(rec, dict) else None
    if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
        raise StoreError(f"malformed generation record at store key {keys.generation!r}")
    return nonce


def join(chan: ChannelStore) -> str:
    """The channel's generation, created here if the store has none yet."""
    keys = chan.keys
    gen = current(chan)
    if gen is None:
        mine = os.urandom(16).hex()
        chan.store.compare_set(keys.generation, None, chan.sealed(keys.generation, {"nonce": mine}))
        gen = current(chan)  # ours, or the one a racing client wrote first
        if gen is None:
            raise StoreError(f"store key {keys.generation!r} vanished right after it was written")
    return gen


__all__ = ["current", "join", "parse"]
