"""Child-process bodies for the store tests (module level, so ``spawn`` can import them)."""

from __future__ import annotations

import os
import time

from wbridge.errors import StoreError
from wbridge.store import open_store


def adder(url: str, key: str, n: int, out) -> None:
    with open_store(url, connect_timeout=20) as s:
        out.put([s.add(key, 1) for _ in range(n)])


def claimer(url: str, keys: list[str], ident: bytes, go, out) -> None:
    with open_store(url, connect_timeout=20) as s:
        go.wait(30)
        out.put((ident, [k for k in keys if s.compare_set(k, None, ident)]))


def cas_incrementer(url: str, key: str, n: int, out) -> None:
    """Increments a counter n times with a get/compare_set loop (tests compare_set atomicity).

    Each write is unique (``count:pid:i``): tcp:// cannot tell "I set it" from "it already held my
    value" (torch's compare_set returns the current value), so writers must not write equal values.
    """
    with open_store(url, connect_timeout=20) as s:
        done = 0
        while done < n:
            old = s.get(key)
            count = int(old.split(b":")[0]) if old else 0
            if s.compare_set(key, old, f"{count + 1}:{os.getpid()}:{done}".encode()):
                done += 1
        out.put(done)


def setter(url: str, key: str, values: list[bytes | None], go, out) -> None:
    """Waits for ``go`` each time, then sets (or deletes, for None) ``key``."""
    with open_store(url, connect_timeout=20) as s:
        out.put("ready")
        for v in values:
            go.get(timeout=30)
            if v is None:
                s.delete(key)
            else:
                s.set(key, v)


def lease_holder(url: str, key: str, ttl: float, out) -> None:
    """Holds a lease until killed."""
    s = open_store(url, connect_timeout=20)
    s.lease(key, ttl)
    out.put("leased")
    time.sleep(600)


def steady_adder(url: str, key: str, stop, out) -> None:
    """Adds 1 until ``stop``; reports (successes, failures). Each call is bounded by the store."""
    with open_store(url, connect_timeout=20) as s:
        ok = failed = 0
        while not stop.is_set():
            try:
                s.add(key, 1)
                ok += 1
            except StoreError:
                failed += 1
            time.sleep(0.01)
        out.put((ok, failed))
