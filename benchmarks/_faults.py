"""Faults the soak injects besides killing subscribers: losing the store, a slowloris client, a
store client without the token that replays records of a lost history (``Replayer``); and the
processes it checks with: subscribers that tell which history's content they hold (``SoakSub``),
and watchers that follow versions by themselves as an engine's watcher does (``Watcher``)."""

from __future__ import annotations

import base64
import collections
import json
import os
import shutil
import socket
import threading
import time
from typing import Any

from tests.runtime.actors import TOKEN, SubActor, model
from transports.base import decode_descriptor
from wbridge import Subscriber, WaitTimeout, WBridgeError, open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.protocol.records import open_sealed
from wbridge.testing.synthetic import make_tensors, mismatches


def lose_store(url: str, store: Any, etcd: Any, replay: bool = False) -> Any:
    """The store comes back empty: the hosted TCPStore is closed and a fresh one hosted on the same
    port, or etcd is killed, its data wiped, and restarted. Returns the new hosted store (tcp).
    ``replay``: the channel's generation record is kept (as a store client without the token
    could) and put back into the emptied store before anyone writes another one."""
    key = Keys("t").generation
    kept = None
    if replay:
        spy = store if store is not None else open_store(url, connect_timeout=10.0)
        kept = spy.get(key)
        if spy is not store:
            spy.close()
    if etcd is not None:
        etcd.kill()
        shutil.rmtree(os.path.join(etcd.data_dir, "data"), ignore_errors=True)
        etcd.start()
        new = None
    else:
        store.close()
        deadline = time.monotonic() + 30.0
        while True:
            try:
                new = open_store(url, host_store=True)
                break
            except Exception:  # noqa: BLE001 - the port may linger a moment
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    if kept is not None:
        spy = new if new is not None else open_store(url, connect_timeout=10.0)
        if not spy.compare_set(key, None, kept):
            print("soak: the replay lost the race (a client wrote a new generation first)", flush=True)
        if spy is not new:
            spy.close()
    return new


def tcp_endpoints(url: str, ranks: int) -> list[tuple[str, int]]:
    """Where each publisher rank's tcp transport listens (from its record in the store)."""
    out = []
    with open_store(url) as store:
        keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN.encode())))
        for r in range(ranks):
            rec = open_sealed(TOKEN.encode(), keys.rank(1, r), store.get(keys.rank(1, r)))
            d = decode_descriptor("tcp", base64.b64decode(rec["transports"]["tcp"]["endpoint"]), ("host", "port"))
            out.append((d["host"], int(d["port"])))
    return out


class Slowloris:
    """``per_rank`` connections to every rank's tcp server that trickle a byte a second and never
    authenticate; a closed one is opened again (at most once a second)."""

    def __init__(self, url: str, ranks: int, per_rank: int) -> None:
        self.targets = [a for a in tcp_endpoints(url, ranks) for _ in range(per_rank)]
        self.socks: list[socket.socket | None] = [None] * len(self.targets)
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-slowloris", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for i, addr in enumerate(self.targets):
                s = self.socks[i]
                try:
                    if s is None:
                        s = self.socks[i] = socket.create_connection(addr, timeout=1.0)
                        s.setblocking(False)
                        self.reopened += 1
                    s.send(b"\0")  # never a whole frame header: the handshake never completes
                    if s.recv(1) == b"":
                        raise ConnectionError
                except BlockingIOError:
                    pass
                except OSError:
                    if s is not None:
                        s.close()
                    self.socks[i] = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            if s is not None:
                s.close()


# -- a store client without the token ---------------------------------------------------------------


def generation_of(store: Any) -> str | None:
    """The channel's store generation as any store client reads it: the nonce in the generation
    record's body (records are signed, not encrypted; no token needed to read one)."""
    raw = store.get(Keys("t").generation)
    return None if raw is None else json.loads(json.loads(raw)["body"])["nonce"]


class Replayer:
    """A store client without the token that keeps the checksum records of a store history
    (``keep`` after each commit) and, once the store lost that history and its generation record
    was put back (the same key names again), puts them back over the new history's (``replay``):
    each one a record signed by the channel's token for its very key, but of another history.

    - ``ranks``: the publisher ranks whose records are kept.
    """

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.kept: dict[int, dict[str, bytes]] = {}  # version -> {key: record} of the current history
        self.gen: str | None = None  # the generation they were kept under
        self.old: dict[int, dict[str, bytes]] = {}  # those of the history before, replayable
        self.old_gen: str | None = None  # and its generation

    def keep(self, store: Any, v: int) -> None:
        """Keeps the checksum records of version ``v`` (committed just now)."""
        gen = generation_of(store)
        if gen != self.gen:
            self.kept, self.gen = {}, gen
        keys = [Keys("t", gen).sums(v, r) for r in range(self.ranks)]
        self.kept[v] = {k: raw for k, raw in zip(keys, store.get_many(keys)) if raw is not None}

    def history_lost(self) -> None:
        """The store lost the history kept so far: it becomes the one replayed from."""
        self.old, self.old_gen, self.kept = self.kept, self.gen, {}

    def can_replay(self, store: Any, v: int) -> bool:
        """Whether the old history has records of ``v`` under the store's current generation."""
        return bool(self.old.get(v)) and generation_of(store) == self.old_gen

    def replay(self, store: Any, v: int) -> int:
        """Puts the old history's checksum records of ``v`` over the current ones; returns how many."""
        for key, raw in self.old[v].items():
            store.set(key, raw)
        return len(self.old[v])

    def restore(self, store: Any, v: int) -> None:
        """Puts the current history's own checksum records of ``v`` back (kept by ``keep``)."""
        for key, raw in self.kept.get(v, {}).items():
            store.set(key, raw)


# -- the processes the soak checks ------------------------------------------------------------------


def content_of(tensors: dict, v: int, offset: int, histories: int) -> int | None:
    """Which content ``tensors`` hold whole as version ``v``: ``v + offset * k`` (history ``k``,
    newest first) or None (none: torn)."""
    for k in reversed(range(histories)):
        if not mismatches(tensors, v + offset * k):
            return v + offset * k
    return None


class SoakSub(SubActor):
    """A soak subscriber: ``pull`` also says which history's content the tensors hold
    (``content_of``); ``offset``: the content offset of one history, ``histories``: how many
    the run has."""

    def __init__(self, *args: Any, offset: int, histories: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offset, self.histories = offset, histories

    def pull(self, min_version: int | None = None, timeout: float = 30.0, history: int = 0, **kwargs: Any) -> dict:
        """``SubActor.pull``, and ``content``: the content held (None: torn); ``bad`` lists the
        tensors that differ from history ``history``'s values of the version pulled."""
        r = super().pull(min_version, timeout, **kwargs)
        r["content"] = None if r["untouched"] else content_of(self.tensors, r["v"], self.offset, self.histories)
        if r["content"] is None:
            r["bad"] = mismatches(self.tensors, r["v"] + self.offset * history)
        return r


WATCH_WAIT_S = 2.0  # a watcher's wait_version() timeout: it waits again after one


class Watcher:
    """A stand-in for an engine's watcher: a registered subscriber whose own thread waits for a
    version above the one it holds (``wait_version``) and pulls it (``pull(min_version=v)``), never
    told to by the driver. Each pull is logged with the content it left (``content_of``) and when
    it began; errors are counted by type and the loop goes on.

    - ``url``, ``tp``, ``rank``, ``fused``, ``model_kind``: the store and the tensors (``SubActor``'s).
    - ``offset``, ``histories``: as ``SoakSub``'s.
    - ``pull_timeout``: each pull's timeout.
    - ``kwargs``: ``Subscriber`` options.
    """

    def __init__(
        self,
        url: str,
        tp: int,
        rank: int,
        *,
        fused: bool,
        model_kind: str,
        offset: int,
        histories: int,
        pull_timeout: float,
        **kwargs: Any,
    ) -> None:
        self.offset, self.histories, self.pull_timeout = offset, histories, pull_timeout
        self.tensors = make_tensors(model(model_kind), tp, rank, fused=fused, version=None, fill_value=0x5A)
        self.sub = Subscriber("t", url, token=TOKEN, **kwargs)
        self.sub.register(self.tensors)
        self.log: list[tuple[int, int | None, float]] = []  # (version, content, when the pull began)
        self.errors: collections.Counter[str] = collections.Counter()
        self.busy_since: float | None = None  # when the call in progress began
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.busy_since = time.monotonic()
                v = self.sub.wait_version(timeout=WATCH_WAIT_S)
                began = time.time()
                got = self.sub.pull(min_version=v, timeout=self.pull_timeout)
            except WaitTimeout:
                continue
            except WBridgeError as e:  # a store coming back, a record of another history...: go on
                with self._lock:
                    self.errors[type(e).__name__] += 1
                self._stop.wait(0.2)
                continue
            finally:
                self.busy_since = None
            content = content_of(self.tensors, got, self.offset, self.histories)
            with self._lock:
                self.log.append((got, content, began))

    def state(self) -> dict:
        """The pulls logged since the last call, the newest one, the errors so far and for how
        long the call in progress has run."""
        with self._lock:
            pulls, self.log = self.log, []
            busy = self.busy_since
            return {
                "pulls": pulls,
                "errors": dict(self.errors),
                "busy_s": 0.0 if busy is None else time.monotonic() - busy,
            }

    def finish(self) -> dict:
        """Stops the loop; ``state()`` and what the tensors hold now (``sub.version`` and its content)."""
        self._stop.set()
        self._thread.join(self.pull_timeout + WATCH_WAIT_S + 5.0)
        out = self.state()
        v = self.sub.version
        out |= {
            "stopped": not self._thread.is_alive(),
            "v": v,
            "content": None if v is None else content_of(self.tensors, v, self.offset, self.histories),
        }
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.pull_timeout + WATCH_WAIT_S + 5.0)
        self.sub.close()
