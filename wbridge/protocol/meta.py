"""Channel metadata: a small JSON value the publishers attach to a registration.

What a subscriber needs to know about a channel before it can even say what to read (the adapter
config of a LoRA channel: rank, alpha, target modules, dtype) travels here, not in a file beside
the weights. ``Publisher.register(metadata=...)`` on publisher rank 0 writes it, with the epoch
of that registration, to the channel's ``meta`` key (``keys.Keys.meta``: ``wb/c/g/<g>/meta``),
sealed with the channel's token like every record; each registration overwrites it (one key per
channel and store generation), a registration without metadata with ``{}``.
``Subscriber.metadata()`` reads it, waiting for the first registration if there is none yet, so
an engine can allocate what it will pull before a first version is published.

A value is a JSON object (a ``dict`` with ``str`` keys, values JSON-able: no NaN, no bytes) of at
most ``MAX_META_BYTES`` encoded bytes; anything else is a ``UsageError`` when it is registered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import StoreError, UsageError
from .channel import ChannelStore

MAX_META_BYTES = 64 * 1024  # encoded JSON; store records stay small


def check(meta: Any, who: str) -> dict | None:
    """``meta`` as it will be stored (a JSON round trip of it), or None; a ``UsageError`` names
    what cannot be stored."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise UsageError(f"{who}: metadata must be a mapping (a JSON object), got {type(meta).__name__}")
    try:
        text = json.dumps(dict(meta), allow_nan=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise UsageError(f"{who}: metadata is not JSON: {e}") from None
    if len(text.encode()) > MAX_META_BYTES:
        raise UsageError(f"{who}: metadata is {len(text.encode())} bytes encoded, more than {MAX_META_BYTES}")
    return json.loads(text)


def write(chan: ChannelStore, epoch: int, meta: dict | None) -> None:
    """Publisher rank 0, at each registration: the channel's metadata as of ``epoch``."""
    chan.write(chan.keys.meta, {"epoch": epoch, "meta": meta or {}})


def parse(chan: ChannelStore, raw: bytes) -> tuple[int, dict]:
    """``(epoch, metadata)`` from the bytes of the ``meta`` key; ``StoreError`` if malformed."""
    rec = chan.open(chan.keys.meta, raw)
    meta = rec.get("meta") if isinstance(rec, dict) else None
    epoch = rec.get("epoch") if isinstance(rec, dict) else None
    if not isinstance(meta, dict) or type(epoch) is not int:  # noqa: E721 - bool is no epoch
        raise StoreError(f"malformed channel metadata at {chan.keys.meta!r}")
    return epoch, meta


__all__ = ["MAX_META_BYTES", "check", "parse", "write"]
