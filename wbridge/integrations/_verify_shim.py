"""TEMPORARY: ``Subscriber.verify(timeout)`` until it lands in main (then this module goes).

It checks the bytes the registered tensors hold against the publishers' checksums of the version
held and returns that version (``IntegrityError`` on a mismatch, ``UsageError`` when nothing is
held or the publishers keep no checksums, ``StaleVersionError`` when that version's checksums
were collected).
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import UsageError


def verify_subscriber(subscriber: Any, timeout: float) -> int:
    if callable(getattr(subscriber, "verify", None)):
        return subscriber.verify(timeout=timeout)
    from ..protocol.version import VersionRecord
    from ..pull.reads import verify_sources

    ctx = subscriber._ctx  # noqa: SLF001 - temporary shim
    v = ctx.version
    if v is None or ctx.session is None:
        raise UsageError(f"subscriber {subscriber.name}: verify() holds no version")
    raw = ctx.store.get(ctx.keys.ready(v))
    if raw is None:
        from ..errors import StaleVersionError

        raise StaleVersionError(f"subscriber {subscriber.name}: the record of version {v} was collected")
    rec = VersionRecord.parse_ready(ctx.chan, v, raw)
    if not rec.checksums:
        raise UsageError(f"subscriber {subscriber.name}: the publishers keep no checksums to verify against")
    verify_sources(ctx, ctx.session.sources, rec, time.monotonic() + timeout, partial=True)
    return v
