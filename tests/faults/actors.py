"""Fault-test processes: the runtime actors plus what fault tests need (re-registering after a
restart, the subscriber list, joining a test host's network namespace), and helpers to stop a pull
half-way (``wbridge.testing.faults.Pause``) and wait for it."""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tests.runtime.actors import TOKEN, PubActor, SubActor
from tests.runtime.harness import Worker
from wbridge import Async, Staging, StoreError, Subscriber, WaitTimeout
from wbridge.testing.synthetic import ModelConfig, make_tensors, mismatches

CLONE_NEWNET = 0x40000000


def join_netns(name: str) -> None:
    """Moves this process into network namespace ``name`` (``ip netns``). Called first thing in a
    freshly forked worker, while it has one thread: threads started later inherit the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(netns: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A ``Worker`` factory: ``Worker("pub", in_netns, host.name, FaultPub, ...)`` runs on that test host."""
    join_netns(netns)
    return factory(*args, **kwargs)


def pub_on(host: Any, url: str, **kwargs: Any) -> Worker:
    """A ``FaultPub`` worker on test host ``host`` (a ``tests.hosts.Host``): rank 0 of 1 for 1
    subscriber, tiny model, serving tcp on the host's address, ``async`` (``max_staleness=10``);
    ``kwargs`` add to or override those."""
    opts = dict(model_kind="tiny", host=host.addr, transport="tcp", mode=Async(max_staleness=10)) | kwargs
    return Worker(f"pub@{host.addr}", in_netns, host.name, FaultPub, url, 0, 1, 1, **opts)


def sub_on(host: Any, url: str, **kwargs: Any) -> Worker:
    """A ``FaultSub`` worker (rank 1, not fused, tiny model, tcp) on test host ``host``; ``kwargs``
    add to or override those."""
    opts = dict(fused=False, model_kind="tiny", host=host.addr, transport="tcp") | kwargs
    return Worker(f"sub@{host.addr}", in_netns, host.name, FaultSub, url, 1, 0, **opts)


class FaultPub(PubActor):
    def reregister(self) -> int:
        """Registers again (every rank does after a restart): a new epoch."""
        return self.pub.register(self.tensors)

    def subscribers(self) -> list[dict]:
        return self.pub.subscribers()

    def evict(self, who: int | str) -> int:
        return self.pub.evict(who)

    def epoch(self) -> int:
        return self.pub._reg.epoch  # noqa: SLF001 - test introspection

    def api(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.pub.<method>(...)``: a public call with the test's arguments (bad ones, say)."""
        return getattr(self.pub, method)(*args, **kwargs)

    def held(self) -> dict:
        """What this process holds: open fds, and bytes of memfd (shared memory) mappings."""
        shm = 0
        with open("/proc/self/maps") as f:
            for line in f:
                if "memfd:" in line:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    shm += hi - lo
        return {"fds": len(os.listdir("/proc/self/fd")), "shm": shm}


class FaultSub(SubActor):
    def __init__(self, *args: Any, sub_name: str | None = None, **kwargs: Any) -> None:
        """``sub_name``: the subscriber's ``name`` (``Worker`` takes ``name`` for itself)."""
        super().__init__(*args, **({"name": sub_name} if sub_name else {}), **kwargs)

    def live_key(self) -> str:
        return lease_key(self.sub)

    def api(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``self.sub.<method>(...)``: a public call with the test's arguments (bad ones, say)."""
        return getattr(self.sub, method)(*args, **kwargs)


def one_slot_pub(kind: str, request: Any) -> tuple[Any, str]:
    """A ``FaultPub`` worker (tiny model, tcp transport, ``one_step_off`` with one staging slot: a
    reader holds the slot it reads) on a ``kind`` store (``"tcp"``: hosted by it; ``"etcd"``: the
    test's etcd, through ``request``), and the store's URL."""
    from tests.runtime.harness import Worker, free_port

    kw = dict(model_kind="tiny", mode="one_step_off", staging=Staging(slots=1), transport="tcp")
    if kind == "tcp":
        url = f"tcp://127.0.0.1:{free_port()}"
        return Worker("pub", FaultPub, url, 0, 1, 1, host_store=True, **kw), url
    url = request.getfixturevalue("etcd_url")
    return Worker("pub", FaultPub, url, 0, 1, 1, **kw), url


def pause_fault(
    tmp_path, on_reads: tuple[int, ...], hold: float = 60.0, **pause: Any
) -> tuple[tuple[str, dict], str, str]:
    """A ``fault=`` for ``SubActor`` that stops reads ``on_reads`` half-way until released; returns
    it with the signal and release file paths. ``pause``: more ``Pause`` arguments (``min_bytes``...)."""
    signal_path, release_path = str(tmp_path / "paused"), str(tmp_path / "release")
    fault = (
        "pause",
        {"signal_path": signal_path, "release_path": release_path, "hold": hold, "on_reads": on_reads, **pause},
    )
    return fault, signal_path, release_path


def wait_paused(signal_path: str, count: int, timeout: float = 30.0) -> None:
    """Blocks until ``count`` reads stopped half-way (each appends a line to ``signal_path``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(signal_path) as f:
                if len(f.readlines()) >= count:
                    return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {count} paused reads within {timeout}s")
        time.sleep(0.01)


def release(release_path: str) -> None:
    open(release_path, "w").close()


class Churn:
    """Subscribers that come and go: ``lifetimes`` of them on ``threads`` threads of this process,
    each joining (own store connection), pulling 1-2 versions (every byte checked) and leaving
    (``close``), or, with ``forever=True``, pulling until the process dies."""

    def __init__(
        self, url: str, seed: int, lifetimes: int, threads: int, *, ttl: float = 2.0, forever: bool = False
    ) -> None:
        self.url, self.seed, self.ttl, self.forever = url, seed, ttl, forever
        self.stats = {"joined": 0, "join_retries": 0, "left": 0, "pulls": 0, "torn": 0, "hangs": 0, "errors": {}}
        self.leases: set[str] = set()  # every lease key its subscribers held (``Keys.lease``)
        self._lock = threading.Lock()
        share = [list(range(t, lifetimes, threads)) for t in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(ids,), daemon=True) for ids in share]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def joined(self) -> int:
        return self.stats["joined"]

    def left(self) -> int:
        return self.stats["left"]

    def lease_keys(self) -> list[str]:
        with self._lock:
            return sorted(self.leases)

    def finish(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return dict(self.stats, running=sum(t.is_alive() for t in self._threads))

    def _join(self, i: int, tensors: dict) -> Subscriber:
        """A subscriber that registered; a join that failed on the store (a connect timing out on
        an overloaded machine) is retried, as a rollout worker would, and counted."""
        for attempt in range(5):
            sub = Subscriber("t", self.url, token=TOKEN, transport="tcp", lease_ttl=self.ttl, name=f"churn{i}")
            try:
                sub.register(tensors)
                self._count("joined")
                self._held(sub)
                return sub
            except StoreError:
                self._held(sub)  # (a join that failed after taking its lease: collected all the same)
                sub.close()
                if attempt == 4:
                    raise
                self._count("join_retries")
        raise AssertionError("unreachable")

    def _held(self, sub: Subscriber) -> None:
        key = lease_key(sub)
        if key is not None:
            with self._lock:
                self.leases.add(key)

    def _count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.stats[what] += n

    def _run(self, lifetimes: list[int]) -> None:
        for i in lifetimes:
            rng = random.Random(self.seed * 100003 + i)
            tp = rng.choice((1, 2))
            tensors = make_tensors(ModelConfig.tiny(), tp, rng.randrange(tp), fused=rng.random() < 0.5, version=None)
            sub = self._join(i, tensors)
            try:
                last, pulls = 0, (1 << 30) if self.forever else rng.randint(1, 2)
                for _ in range(pulls):
                    for t, _ in tensors.values():
                        t.view(-1).view(torch.uint8).fill_(0xA5)
                    try:
                        last = sub.pull(min_version=last + 1, timeout=30.0)
                    except WaitTimeout:
                        self._count("hangs")
                        break
                    except Exception as e:  # noqa: BLE001 - counted by type, reported by the test
                        with self._lock:
                            self.stats["errors"][type(e).__name__] = self.stats["errors"].get(type(e).__name__, 0) + 1
                        continue
                    self._count("pulls")
                    if mismatches(tensors, last):
                        self._count("torn")
            finally:
                self._held(sub)  # (a join again under a new id holds another lease)
                sub.close()
                self._count("left")


def lease_key(sub: Subscriber) -> str | None:
    """The lease key ``sub``'s current join holds (``Keys.lease``: under its id and its join's tag),
    None where it holds none."""
    lease = sub._ctx.member.lease  # noqa: SLF001 - test introspection
    return None if lease is None else lease.key
