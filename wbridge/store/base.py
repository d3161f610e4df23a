"""The store interface: a small key-value service shared by publishers and subscribers.

``open_store(url, ...)`` returns a ``Store``. ``tcp://host:port`` is torch's TCPStore (the embedded
default, hosted by one publisher); ``etcd://host:port[,host:port]`` is etcd v3 for clusters.

Call protocol: open, then any of get/get_many/set/compare_set/add/delete/delete_many/wait/wait_change
from any thread, ``lease``/``is_alive``/``judge_alive`` for liveness, ``close()`` (idempotent).
``get_many`` and ``delete_many`` are one request for many keys where the store can batch (TCPStore
``multi_get``, an etcd transaction); ``wait`` blocks in the store where it can (a TCPStore wait, an
etcd watch) instead of polling. Every blocking call takes a timeout
and raises ``WaitTimeout`` (a ``WBridgeError``) when it expires; a lost connection is ``StoreError``.
Values are bytes. The store is not trusted: wbridge signs what it writes (see ``records``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

from ..errors import StoreError, WaitTimeout

DEFAULT_CONNECT_TIMEOUT = 30.0


class Lease:
    """A liveness record kept fresh by a background thread until ``revoke()``. ``lapsed`` tells
    its holder that it went unrefreshed for longer than ``ttl`` (the process was frozen, the store
    unreachable) at least once: others may have counted it dead meanwhile."""

    def __init__(self, key: str, ttl: float, refresh: Callable[[], None], revoke: Callable[[], None]) -> None:
        self.key = key
        self.ttl = ttl
        self._refresh = refresh
        self._revoke = revoke
        self._last_ok = time.monotonic()  # the clock runs on while the process is stopped
        self._lapsed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wbridge-lease:{key}", daemon=True)
        self._thread.start()

    @property
    def lapsed(self) -> bool:
        return self._lapsed or time.monotonic() - self._last_ok > self.ttl

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self._refresh()
            except Exception:  # noqa: BLE001 - a store hiccup must not kill the lease thread
                continue
            now = time.monotonic()
            if now - self._last_ok > self.ttl:
                self._lapsed = True
            self._last_ok = now

    def revoke(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.ttl)
        try:
            self._revoke()
        except Exception:  # noqa: BLE001 - best effort: the lease lapses on its own
            pass

    def __repr__(self) -> str:
        return f"Lease({self.key!r}, ttl={self.ttl}, active={not self._stop.is_set()})"


class Store(ABC):
    """Base class; see the module docstring."""

    url: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value of ``key`` or ``None``; never blocks on a missing key."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of ``keys`` in order (``None`` where absent); one request where the store
        batches reads. The default reads them one by one."""
        return [self.get(k) for k in keys]

    @abstractmethod
    def set(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def compare_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Sets ``key`` to ``value`` if it holds ``expected`` (``None``: absent); True on success.

        On ``tcp://`` success is inferred from the value found afterwards, so concurrent writers
        must write distinct values to know who won; on ``etcd://`` it is exact."""

    @abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically adds ``delta`` to the integer at ``key`` (absent is 0); returns the new value."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def delete_many(self, keys: Sequence[str]) -> None:
        """Deletes ``keys`` (absent ones are fine); one request where the store batches writes."""
        for k in keys:
            self.delete(k)

    @abstractmethod
    def lease(self, key: str, ttl: float) -> Lease:
        """Marks ``key`` alive for as long as the returned lease is refreshed (every ``ttl/4``)."""

    def is_alive(self, key: str, ttl: float) -> bool:
        """Whether the lease at ``key`` was refreshed within the last ``ttl`` seconds (as seen here)."""
        return self.judge_alive(key, self.get(key), ttl)

    @abstractmethod
    def judge_alive(self, key: str, value: bytes | None, ttl: float) -> bool:
        """``is_alive`` for a lease key whose ``value`` the caller just read (say in a ``get_many``)."""

    @abstractmethod
    def close(self) -> None: ...

    @contextlib.contextmanager
    def deadline(self, at: float) -> Iterator[None]:
        """Bounds every call this thread makes inside the block by ``at`` (``time.monotonic()``);
        an inner block's deadline replaces the outer one until it ends. Each store reads it with
        ``caller_deadline()``."""
        local = self._deadlines()
        prev = getattr(local, "at", None)
        local.at = at
        try:
            yield
        finally:
            local.at = prev

    def caller_deadline(self) -> float | None:
        """The deadline this thread's calls run under (``deadline()``), or None."""
        return getattr(self._deadlines(), "at", None)

    def _deadlines(self) -> threading.local:
        local = self.__dict__.get("_deadline_local")
        if local is None:
            local = self.__dict__.setdefault("_deadline_local", threading.local())
        return local

    def get_int(self, key: str, default: int = 0) -> int:
        raw = self.get(key)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise StoreError(f"store key {key!r} holds {raw[:40]!r}, not an integer") from None

    def wait(self, key: str, timeout: float) -> bytes:
        """Blocks until ``key`` exists; returns its value."""
        value = self.wait_until(lambda: self.get(key), timeout, f"store key {key!r}")
        return value

    def wait_change(self, key: str, old: bytes | None, timeout: float) -> bytes | None:
        """Blocks until ``key`` holds something other than ``old``; returns it (a watch)."""
        sentinel = object()

        def changed():
            v = self.get(key)
            return sentinel if v == old else (v,)

        out = self.wait_until(lambda: None if (r := changed()) is sentinel else r, timeout, f"change of {key!r}")
        return out[0]

    @staticmethod
    def wait_until(
        probe: Callable[[], object], timeout: float, what: str, poll: float = 0.0005, max_poll: float = 0.02
    ) -> object:
        """Polls ``probe`` with backoff until it returns something other than None."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value is not None:
                return value
            now = time.monotonic()
            if now >= deadline:
                raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for {what}")
            time.sleep(min(poll, deadline - now))
            poll = min(poll * 2, max_poll)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
