"""``etcd://host:port[,host:port...][/prefix]``: the metadata store on etcd v3, for clusters.

Talks to etcd's HTTP/JSON gateway (``/v3/...``) through the ``etcd3gw`` client (pip extra
``wbridge[etcd]``): its put, delete, txn and lease calls, over a ``post`` we override to give every
request a deadline and to tell "never sent" from "outcome unknown". Reads and the watch stream are raw
gateway requests on the same session (etcd3gw's ``get`` drops the revision a watch must start after,
and its ``Watcher`` opens the stream with no timeout). Keys live under a prefix (default
``/wbridge/``; a URL path overrides it).

- Every call is bounded: it retries within ``op_timeout`` (default ``connect_timeout``; sooner under a
  caller's ``deadline()``) across the
  endpoints (failover) and across an etcd restart, then raises ``StoreError``. Waits raise
  ``WaitTimeout``.
- ``add`` is a compare-and-swap transaction loop; ``compare_set`` one transaction; ``get_many`` and
  ``delete_many`` one read-only (or delete-only) transaction per ``TXN_OPS`` keys.
- ``lease`` grants a real etcd lease, attaches ``key`` to it and keeps it alive from a thread; if the
  lease was lost (etcd down longer than the TTL) it is re-granted and ``key`` rewritten. When the holder
  dies, etcd deletes ``key`` after the TTL, so ``is_alive`` is "the key exists".
- ``wait``/``wait_change`` read the key, then follow an etcd watch stream from the next revision (no
  polling); a broken stream (restart, failover, compaction) is re-read and re-watched within the timeout.

A request that may have reached etcd before its connection broke is retried only if it is idempotent
(get, set, delete); ``add`` and ``compare_set`` raise ``StoreError`` then ("outcome unknown"), because a
blind retry could apply them twice. A request that provably never left (connection refused) is retried.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlparse

from .. import _validate
from ..errors import StoreError, UsageError, WaitTimeout
from .base import DEFAULT_CONNECT_TIMEOUT, Lease, Store

try:
    import requests
    from etcd3gw.client import Etcd3Client
except ImportError:  # pragma: no cover - exercised only where the extra is missing
    requests = None
    Etcd3Client = object

T = TypeVar("T")

DEFAULT_PREFIX = "/wbridge/"
# etcd refuses lease TTLs below its minimum (1.5 x election timeout, 1.5 s by default).
MIN_LEASE_TTL = 2
# A refused connection is retried after this pause, doubling up to the cap.
RETRY_PAUSE, RETRY_PAUSE_MAX = 0.05, 0.5
# Operations per transaction: etcd's default --max-txn-ops.
TXN_OPS = 128
# Connect timeout per attempt, so one black-holed endpoint does not eat a whole call's budget.
CONNECT_ATTEMPT_TIMEOUT = 2.0


class _NotSent(Exception):
    """The request never reached etcd (connection refused or connect timeout): safe to retry."""


class _Unknown(Exception):
    """The connection broke after the request left: it may or may not have been applied."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store {what} must be bytes or str, not {type(value).__name__}")


if requests is not None:

    class _Client(Etcd3Client):
        """``Etcd3Client`` with a per-thread deadline and errors that say whether a retry is safe."""

        def __init__(self, host: str, port: int, api_path: str) -> None:
            super().__init__(host=host, port=port, api_path=api_path)
            self.local = threading.local()

        def timeouts(self) -> tuple[float, float]:
            left = getattr(self.local, "deadline", time.monotonic() + 10.0) - time.monotonic()
            left = max(left, 0.05)
            return min(left, CONNECT_ATTEMPT_TIMEOUT), left

        def post(self, url: str, *args: Any, json: Any = None, **kwargs: Any) -> Any:  # noqa: A002
            try:
                resp = self.session.post(url, *args, json=json, timeout=self.timeouts(), **kwargs)
            except (requests.exceptions.ConnectTimeout, requests.exceptions.InvalidURL) as e:
                raise _NotSent(str(e)) from e
            except requests.exceptions.ConnectionError as e:
                if _refused(e):
                    raise _NotSent(str(e)) from e
                raise _Unknown(str(e)) from e
            except requests.exceptions.RequestException as e:
                raise _Unknown(str(e)) from e
            if resp.status_code == 200:
                return resp.json()
            # The gateway answers gRPC errors as JSON {"error": ..., "code": ...}. 503 covers "no
            # leader" (not applied) but also "request timed out" (may still commit): treat as unknown.
            if resp.status_code == 503:
                raise _Unknown(f"etcd unavailable: {resp.text[:200]}")
            raise StoreError(f"etcd {self.base_url} answered {resp.status_code}: {resp.text[:300]}")


def _refused(e: requests.exceptions.ConnectionError) -> bool:
    """Whether a requests ConnectionError happened while connecting (so nothing was sent)."""
    from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError

    cause = e.args[0] if e.args else None
    if isinstance(cause, MaxRetryError):
        cause = cause.reason
    return isinstance(cause, (NewConnectionError, ConnectTimeoutError, ConnectionRefusedError))


class EtcdLease(Lease):
    """A key attached to an etcd lease; a background thread sends keep-alives every ``ttl/4``."""

    def __init__(self, store: EtcdStore, key: str, ttl: float) -> None:
        self._store = store
        self.key = key  # the base class sets it too, but _grant needs it first
        self._etcd_ttl = max(MIN_LEASE_TTL, int(-(-ttl // 1)))
        self._etcd_lease = None  # etcd3gw's Lease: the id, with grant/keepalive/revoke calls
        self._grant(ttl)
        super().__init__(key, ttl, refresh=lambda: self._keepalive(ttl), revoke=lambda: self._drop(ttl))

    def _grant(self, timeout: float) -> None:
        # Grant and attach; a failure before the key is written leaves only an orphan lease, which
        # etcd drops after its TTL.
        full = self._store._key(self.key)
        lease = self._store._retry(
            lambda c: c.lease(self._etcd_ttl), timeout, f"grant a lease for {self.key!r}", idempotent=True
        )
        self._store._retry(
            lambda c: c.put(full, str(lease.id).encode(), lease=lease),
            timeout,
            f"attach lease to {self.key!r}",
            idempotent=True,
        )
        self._etcd_lease = lease

    @property
    def lease_id(self) -> int:
        return self._etcd_lease.id if self._etcd_lease is not None else 0

    def _keepalive(self, timeout: float) -> None:
        # Through the current endpoint's client: after a failover the lease object's own may be dead.
        ttl = self._store._retry(
            lambda c: self._with_client(c).refresh(), timeout, f"keep lease {self.key!r} alive", idempotent=True
        )
        if ttl <= 0:
            # etcd expired it (it was unreachable for longer than the TTL): take a fresh one.
            self._grant(timeout)

    def _drop(self, timeout: float) -> None:
        self._store._forget(self)
        self._store._retry(
            lambda c: self._with_client(c).revoke(), min(timeout, 5.0), f"revoke lease {self.key!r}", idempotent=True
        )

    def _with_client(self, client: _Client):
        self._etcd_lease.client = client
        return self._etcd_lease

    def __repr__(self) -> str:
        return f"EtcdLease({self.key!r}, ttl={self.ttl}, id={self.lease_id:x}, active={not self._stop.is_set()})"


class EtcdStore(Store):
    """See the module docstring. ``url`` is ``etcd://host:port[,host:port...][/prefix]``."""

    def __init__(
        self,
        url: str,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        prefix: str | None = None,
        op_timeout: float | None = None,
    ) -> None:
        if requests is None:
            raise StoreError("etcd:// stores need the etcd3gw client: pip install 'wbridge[etcd]'")
        if not isinstance(url, str):
            raise UsageError(f"EtcdStore(url) must be etcd://host:port[,...][/prefix], got {url!r:.80}")
        self.endpoints, url_prefix = parse_url(url)
        if prefix is not None and not isinstance(prefix, (str, bytes)):
            raise UsageError(f"EtcdStore(prefix) must be str, bytes or None, got {prefix!r:.80}")
        self.prefix = _as_bytes(prefix if prefix is not None else (url_prefix or DEFAULT_PREFIX), "prefix")
        self.url = url
        self.connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
        self.op_timeout = _validate.timeout(
            op_timeout if op_timeout is not None else connect_timeout, "op_timeout", positive=True
        )
        self._closed = False
        self._current = 0
        self._lock = threading.Lock()
        self._leases: list[EtcdLease] = []
        api_path = self._probe()
        self._clients = [_Client(h, p, api_path) for h, p in self.endpoints]

    # -- connection handling -------------------------------------------------------------------

    def _probe(self) -> str:
        """Waits up to ``connect_timeout`` for any endpoint to answer; returns its API path."""
        deadline = time.monotonic() + self.connect_timeout
        pause, errors = RETRY_PAUSE, {}
        while True:
            for host, port in self.endpoints:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    r = requests.get(
                        f"http://{_hostport(host, port)}/version", timeout=(min(left, CONNECT_ATTEMPT_TIMEOUT), left)
                    )
                    version = r.json()["etcdserver"]
                    major, minor = (int(x) for x in version.split(".")[:2])
                    return (
                        "/v3/" if (major, minor) >= (3, 4) else "/v3beta/" if (major, minor) >= (3, 3) else "/v3alpha/"
                    )
                except (requests.exceptions.RequestException, ValueError, KeyError, TypeError) as e:
                    errors[f"{host}:{port}"] = f"{type(e).__name__}: {e}"[:200]
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"store {self.url} unreachable after {self.connect_timeout:.1f}s: {errors}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, RETRY_PAUSE_MAX)

    def _retry(self, fn: Callable[[_Client], T], timeout: float, what: str, idempotent: bool) -> T:
        """Runs ``fn(client)`` until it succeeds or ``timeout`` passes, failing over between endpoints."""
        if self._closed:
            raise StoreError(f"store {self.url} is closed")
        deadline = self._bound(time.monotonic() + timeout)
        pause, last = RETRY_PAUSE, None
        while True:
            index = self._current
            client = self._clients[index]
            client.local.deadline = deadline
            try:
                return fn(client)
            except _NotSent as e:
                last = e
            except _Unknown as e:
                if not idempotent:
                    raise StoreError(f"store {self.url}: connection lost during {what}; outcome unknown: {e}") from e
                last = e
            except (KeyError, ValueError, TypeError, RecursionError) as e:
                raise StoreError(f"store {self.url}: malformed answer to {what}: {type(e).__name__}") from e
            # Next endpoint (another thread may already have moved on).
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self._clients)
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"store {self.url}: could not {what} within {timeout:.1f}s: {last}")
            if self._current == 0 or len(self._clients) == 1:
                time.sleep(min(pause, left))  # a full round failed: back off
                pause = min(pause * 2, RETRY_PAUSE_MAX)

    def _bound(self, deadline: float) -> float:
        """``deadline``, or the caller's if sooner; ``WaitTimeout`` if the caller's has passed."""
        at = self.caller_deadline()
        if at is None:
            return deadline
        if at <= time.monotonic():
            raise WaitTimeout(f"store {self.url}: the caller's deadline passed")
        return min(deadline, at)

    def _key(self, key: str) -> bytes:
        if not isinstance(key, str) or not key:
            raise StoreError(f"store keys are non-empty strings, got {key!r}")
        return self.prefix + key.encode()

    def _range(self, key: str, timeout: float) -> tuple[bytes | None, int, int]:
        """(value or None, key's mod_revision or 0, store revision)."""
        # A raw range request: etcd3gw's get() drops the header, whose revision the watch starts after.
        full = _b64(self._key(key))
        out = self._retry(
            lambda c: c.post(c.get_url("/kv/range"), json={"key": full}), timeout, f"get {key!r}", idempotent=True
        )
        rev = int(out["header"]["revision"])
        kvs = out.get("kvs") or []
        if not kvs:
            return None, 0, rev
        return _unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"]), rev

    def _txn(self, key: str, compare: dict, put: bytes, what: str) -> tuple[bool, bytes | None, int]:
        """One transaction: if ``compare`` holds, put; else read. -> (succeeded, current value, mod_rev)."""
        full = _b64(self._key(key))
        txn = {
            "compare": [dict(compare, key=full)],
            "success": [{"request_put": {"key": full, "value": _b64(put)}}],
            "failure": [{"request_range": {"key": full}}],
        }
        out = self._retry(lambda c: c.transaction(txn), self.op_timeout, what, idempotent=False)
        if out.get("succeeded"):
            return True, put, 0
        kvs = (out.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return False, None, 0
        return False, _unb64(kvs[0].get("value")), int(kvs[0]["mod_revision"])

    # -- Store API -----------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        return self._range(key, self.op_timeout)[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        keys = list(keys)
        for i in range(0, len(keys), TXN_OPS):
            chunk = keys[i : i + TXN_OPS]
            txn = {"success": [{"request_range": {"key": _b64(self._key(k))}} for k in chunk]}
            got = self._retry(lambda c, txn=txn: c.transaction(txn), self.op_timeout, "get many", idempotent=True)
            responses = got.get("responses") or []
            if len(responses) != len(chunk):
                raise StoreError(f"store {self.url}: {len(responses)} answers to a read of {len(chunk)} keys")
            for r in responses:
                kvs = r.get("response_range", {}).get("kvs") or []
                out.append(_unb64(kvs[0].get("value")) if kvs else None)
        return out

    def delete_many(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), TXN_OPS):
            txn = {"success": [{"request_delete_range": {"key": _b64(self._key(k))}} for k in keys[i : i + TXN_OPS]]}
            self._retry(lambda c, txn=txn: c.transaction(txn), self.op_timeout, "delete many", idempotent=True)

    def set(self, key: str, value: bytes) -> None:
        full, value = self._key(key), _as_bytes(value, f"value of {key!r}")
        self._retry(lambda c: c.put(full, value), self.op_timeout, f"set {key!r}", idempotent=True)

    def compare_set(self, key: str, expected: bytes | None, value: bytes) -> bool:
        value = _as_bytes(value, f"value of {key!r}")
        if expected is None:
            compare = {"target": "CREATE", "result": "EQUAL", "create_revision": 0}
        else:
            compare = {"target": "VALUE", "result": "EQUAL", "value": _b64(_as_bytes(expected, "expected value"))}
        return self._txn(key, compare, value, f"compare_set {key!r}")[0]

    def add(self, key: str, delta: int) -> int:
        delta = int(delta)
        value, mod_rev, _ = self._range(key, self.op_timeout)
        deadline = self._bound(time.monotonic() + self.op_timeout)
        while True:
            current = self._parse_int(key, value)
            new = str(current + delta).encode()
            if value is None:
                compare = {"target": "CREATE", "result": "EQUAL", "create_revision": 0}
            else:
                compare = {"target": "MOD", "result": "EQUAL", "mod_revision": mod_rev}
            ok, value, mod_rev = self._txn(key, compare, new, f"add to {key!r}")
            if ok:
                return current + delta
            if time.monotonic() >= deadline:
                raise StoreError(f"store {self.url}: add to {key!r} lost every race for {self.op_timeout:.1f}s")

    @staticmethod
    def _parse_int(key: str, value: bytes | None) -> int:
        if value is None:
            return 0
        try:
            return int(value)
        except ValueError:
            raise StoreError(f"store key {key!r} holds {value[:40]!r}, not an integer") from None

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._retry(lambda c: c.delete(full), self.op_timeout, f"delete {key!r}", idempotent=True)

    def lease(self, key: str, ttl: float) -> Lease:
        if ttl <= 0:
            raise StoreError(f"lease ttl for {key!r} must be positive, got {ttl}")
        lease = EtcdLease(self, key, ttl)
        with self._lock:
            self._leases.append(lease)
        return lease

    def _forget(self, lease: EtcdLease) -> None:
        with self._lock:
            if lease in self._leases:
                self._leases.remove(lease)

    def judge_alive(self, key: str, value: bytes | None, ttl: float) -> bool:
        # etcd expires the key with its lease: existing means its holder kept it alive.
        return value is not None

    def wait(self, key: str, timeout: float) -> bytes:
        value = self.wait_change(key, None, timeout)
        return value  # not None: wait_change returns something other than "absent"

    def wait_change(self, key: str, old: bytes | None, timeout: float) -> bytes | None:
        deadline = self._bound(time.monotonic() + timeout)
        old = None if old is None else _as_bytes(old, "old value")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for a change of store key {key!r}")
            value, _, rev = self._range(key, left)  # StoreError if etcd stays unreachable
            if value != old:
                return value
            found, value = self._watch(key, rev + 1, old, deadline)
            if found:
                return value
            # Stream ended early (etcd restart, compaction, failover): read again, watch again.

    def _watch(self, key: str, start_rev: int, old: bytes | None, deadline: float) -> tuple[bool, bytes | None]:
        """Streams watch events on ``key`` from ``start_rev`` until one differs from ``old`` or time runs out."""
        if self._closed:
            raise StoreError(f"store {self.url} is closed")
        client = self._clients[self._current]
        client.local.deadline = deadline
        body = {"create_request": {"key": _b64(self._key(key)), "start_revision": start_rev}}
        try:
            with client.session.post(
                client.get_url("/watch"), json=body, stream=True, timeout=client.timeouts()
            ) as resp:
                if resp.status_code != 200:
                    return False, None
                buf = b""
                for chunk in resp.iter_content(chunk_size=None):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        if not line.strip():
                            continue
                        result = json.loads(line).get("result", {})
                        if result.get("canceled") or result.get("compact_revision"):
                            return False, None
                        for event in result.get("events", []):
                            kv = event.get("kv", {})
                            value = None if event.get("type") == "DELETE" else _unb64(kv.get("value"))
                            if value != old:
                                return True, value
                    if time.monotonic() >= deadline:
                        return False, None
        except (requests.exceptions.RequestException, ValueError, OSError, RecursionError):
            # Read timeout at the deadline, or the stream broke: the caller re-reads and decides.
            if time.monotonic() < deadline:
                time.sleep(min(RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
                with self._lock:
                    self._current = (self._current + 1) % len(self._clients)
        return False, None

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            leases, self._leases = list(self._leases), []
        for lease in leases:
            lease.revoke()
        self._closed = True
        for c in self._clients:
            c.session.close()

    def __repr__(self) -> str:
        host, port = self.endpoints[self._current]
        return (
            f"EtcdStore({self.url!r}, prefix={self.prefix.decode(errors='replace')!r}, "
            f"endpoint={host}:{port}, leases={len(self._leases)}, closed={self._closed})"
        )


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_url(url: str) -> tuple[list[tuple[str, int]], str | None]:
    """The endpoints ``[(host, port)]`` and the key prefix of an etcd URL; ``StoreError`` if malformed."""
    parsed = urlparse(url)
    if parsed.scheme != "etcd" or not parsed.netloc:
        raise StoreError(f"etcd store url {url!r} must be etcd://host:port[,host:port...][/prefix]")
    endpoints = []
    for part in parsed.netloc.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreError(f"etcd store url {url!r}: endpoint {part!r} needs host:port (port 1..65535)")
        endpoints.append((host, int(port)))
    prefix = parsed.path if parsed.path not in ("", "/") else None
    if prefix is not None and not prefix.endswith("/"):
        prefix += "/"
    return endpoints, prefix
