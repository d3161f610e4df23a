"""Control plane at scale: store requests per version, publish latency and store size with P
publishers and S subscribers on a real TCPStore and a real etcd.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/control_plane.py`` (defaults: ``--publishers 32
--subscribers 256 --stores tcp,etcd``). etcd is skipped with a note when no etcd binary is installed.

Parties are real ``Publisher``/``Subscriber`` objects (``mode="sync"``, ``transport="tcp"``) with
tiny tensors: publisher rank r holds row r of a ``(P, 16)`` float32 tensor, subscriber i wants row
``i % P`` (one source each). Publishers run as threads of one process, subscribers as threads of
``--procs`` processes; every party has its own store connection, wrapped in ``CountingStore``,
which counts calls on wbridge's ``Store`` interface (one call is one request to the store's API; on
tcp:// a ``set`` is a SET plus a CHECK round trip and a ``get_many`` a CHECK plus a MULTI_GET, on
etcd:// a ``get_many`` is one transaction per 128 keys). Lease refreshes (a background thread per
subscriber, every ttl/4 seconds whatever the publish rate) are not counted.

Per store, two runs side by side:

- S=1 and S=``--subscribers``: after ``--warmup`` versions, ``--versions`` versions are timed. All
  publisher threads meet at a barrier, then call ``publish()``; ``publish_ms`` is the median time
  from that barrier to the commit of the version (the version record's ``committed_at``): the
  publishers' own control-plane work (waiting for readers of the slot, fence, snapshot, commit),
  which must not grow with S. ``round_ms`` (detail line) is the whole sync round, until every
  subscriber acked: it includes the subscribers' own pulls, which on a 2-core machine take CPU
  time proportional to S whatever the control plane does. ``requests_per_version`` counts every
  party's requests over the timed versions.
- Store size (with ``--gc-publishers`` publishers and one subscriber; every ``--churn-every``
  versions another subscriber joins, pulls and leaves): keys in the store after 10 and after
  ``--gc-versions`` versions (TCPStore ``num_keys``; an etcd range count under the run's prefix).

etcd runs from a data directory on tmpfs (``/dev/shm``) where there is one, so that this machine's
disk (etcd fsyncs every write) does not dominate the times.

``--breakdown`` lists, per store, the calls per party and version of the S-subscriber run by
operation and kind of key (``get_many [gen,slot/N/fence,sub/N,version]``: a subscriber's first read).

Last line per store: ``control_plane: store=<tcp|etcd> P=<p> S=<s> requests_per_version=<n>
per_party=<n/(p+s)> publish_ms=<t> keys_after_10=<a> keys_after_1000=<b>``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import torch

from wbridge import Publisher, Shard, Store, Subscriber, open_store
from wbridge.protocol import generation as _generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.protocol.version import VersionRecord

CHANNEL, TOKEN, COLS = "cp", b"control-plane-bench", 16
LEASE_TTL = 30.0  # generous: 256 parties on 2 cores must not miss refreshes
CTX = mp.get_context("forkserver")


def _key_kind(key) -> str:
    """A store key without its channel, generation and numbers: ``v/N/e/N/snap``, ``sub/N/state``;
    a list of keys as the set of its kinds."""
    if isinstance(key, (list, tuple)):
        return "[" + ",".join(sorted({_key_kind(k) for k in key})) + "]"
    return re.sub(r"\d+", "N", re.sub(r"^wb/[^/]+/(g/[^/]+/)?", "", str(key)))


class CountingStore(Store):
    """A ``Store`` that forwards every call to ``inner`` and counts it. Helpers that the inner
    store does not override (``wait`` polling with ``get``, say) run here, so that their own calls
    are counted one by one."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.url = inner, inner.url
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def total(self) -> int:
        return sum(self.calls.values())

    def _count(self, op: str, key) -> None:
        """One call of ``op``, filed under the kind of key it names (``--breakdown``)."""
        self.calls[op, _key_kind(key)] += 1

    def _own(self, name: str) -> bool:
        return getattr(type(self.inner), name, None) is not getattr(Store, name, None)

    def get(self, key):
        self._count("get", key)
        return self.inner.get(key)

    def get_many(self, keys):
        if self._own("get_many"):
            self._count("get_many", keys)
            return self.inner.get_many(keys)
        return [self.get(k) for k in keys]

    def set(self, key, value):
        self._count("set", key)
        self.inner.set(key, value)

    def compare_set(self, key, expected, value):
        self._count("compare_set", key)
        return self.inner.compare_set(key, expected, value)

    def add(self, key, delta):
        self._count("add", key)
        return self.inner.add(key, delta)

    def delete(self, key):
        self._count("delete", key)
        self.inner.delete(key)

    def delete_many(self, keys):
        if self._own("delete_many"):
            self._count("delete_many", keys)
            return self.inner.delete_many(keys)
        for k in keys:
            self.delete(k)

    def lease(self, key, ttl):
        self._count("lease", key)
        return self.inner.lease(key, ttl)

    def is_alive(self, key, ttl):
        self._count("is_alive", key)
        return self.inner.is_alive(key, ttl)

    def judge_alive(self, key, value, ttl):
        return self.inner.judge_alive(key, value, ttl)

    def wait(self, key, timeout):
        if self._own("wait"):
            self._count("wait", key)
            return self.inner.wait(key, timeout)
        return Store.wait(self, key, timeout)

    def wait_change(self, key, old, timeout):
        if self._own("wait_change"):
            self._count("wait_change", key)
            return self.inner.wait_change(key, old, timeout)
        return Store.wait_change(self, key, old, timeout)

    @contextlib.contextmanager
    def deadline(self, at: float) -> Iterator[None]:
        with self.inner.deadline(at):
            yield

    def close(self) -> None:
        self.inner.close()


def _sub_tensors(i: int, p: int) -> dict:
    t = torch.zeros(1, COLS)
    return {"w": (t, Shard("w", (p, COLS), offsets=(i % p, 0), sizes=(1, COLS)))}


def _subscriber_proc(url: str, ids: Sequence[int], p: int, conn, stop) -> None:
    """Subscribers ``ids`` as threads, each pulling every version until ``stop``; answers count
    requests on ``conn`` ("count"), and runs churn subscribers ("churn")."""
    subs, stores, errors = [], [], collections.Counter()
    for i in ids:
        store = CountingStore(open_store(url, connect_timeout=60))
        sub = Subscriber(CHANNEL, store, token=TOKEN, transport="tcp", lease_ttl=LEASE_TTL, name=f"s{i}")
        sub.register(_sub_tensors(i, p))
        subs.append(sub)
        stores.append(store)

    def loop(sub: Subscriber) -> None:
        last = 0
        while not stop.is_set():
            try:
                last = sub.pull(min_version=last + 1, timeout=120.0)
            except Exception as e:  # noqa: BLE001 - counted; a timeout just means no new version yet
                if type(e).__name__ != "WaitTimeout":
                    errors[type(e).__name__] += 1

    threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in subs]
    conn.send("ready")
    if conn.recv() != "go":  # every subscriber of every process registered: start pulling
        return
    for t in threads:
        t.start()
    while True:
        msg = conn.recv()
        if msg == "count":
            conn.send((sum((s.calls for s in stores), collections.Counter()), dict(errors)))
        elif msg == "churn":
            store = open_store(url, connect_timeout=60)
            sub = Subscriber(CHANNEL, store, token=TOKEN, transport="tcp", lease_ttl=LEASE_TTL, name="churn")
            sub.register(_sub_tensors(0, p))
            sub.pull(timeout=30.0)
            sub.close()
            conn.send("done")
        else:
            break
    stop.set()
    # a pull blocked on the ready key of a version never published does not return: the threads
    # are daemons, given 2 s in all (not 10 s each) to finish what they were doing
    deadline = time.monotonic() + 2.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for s in subs:
        s.close()
    conn.send("closed")


class Publishers:
    """``p`` publisher ranks as threads of this process, each with its own counted connection."""

    def __init__(self, url: str, p: int) -> None:
        self.p, self.url = p, url
        self.stores = [CountingStore(open_store(url, connect_timeout=60)) for _ in range(p)]
        self.reader = open_store(url, connect_timeout=60)  # uncounted: reads commit times
        self.pubs = []
        for r in range(p):
            pub = Publisher(CHANNEL, self.stores[r], rank=r, world_size=p, token=TOKEN, transport="tcp", mode="sync")
            t = torch.full((1, COLS), float(r))
            pub.register({"w": (t, Shard("w", (p, COLS), offsets=(r, 0), sizes=(1, COLS)))})
            self.pubs.append(pub)

    def requests(self) -> collections.Counter:
        return sum((s.calls for s in self.stores), collections.Counter())

    def publish(self, n: int, timeout: float = 300.0) -> tuple[list[float], list[float]]:
        """Publishes ``n`` versions; returns per version (barrier -> commit, barrier -> all returned)."""
        commit_ms, round_ms = [], []
        for _ in range(n):
            barrier = threading.Barrier(self.p + 1)
            done: list[BaseException | None] = [None] * self.p
            threads = [threading.Thread(target=self._one, args=(r, barrier, done, timeout)) for r in range(self.p)]
            for t in threads:
                t.start()
            barrier.wait()
            t0 = time.time()
            for t in threads:
                t.join()
            t1 = time.time()
            errs = [e for e in done if e is not None]
            if errs:
                raise errs[0]
            base = Keys(CHANNEL)
            chan = ChannelStore(self.reader, base, TOKEN)
            rec = VersionRecord.read(chan.at(_generation.current(chan)))
            commit_ms.append((rec.committed_at - t0) * 1e3)
            round_ms.append((t1 - t0) * 1e3)
        return commit_ms, round_ms

    def _one(self, r: int, barrier: threading.Barrier, done: list, timeout: float) -> None:
        barrier.wait()
        try:
            self.pubs[r].publish(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised by publish()
            done[r] = e

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        self.reader.close()


class Run:
    """One run on a fresh store: P publishers here, S subscribers in ``procs`` processes."""

    def __init__(self, env: StoreEnv, p: int, s: int, procs: int) -> None:
        self.url = env.fresh()
        self.env = env
        self.pubs = Publishers(self.url, p)
        self.stop = CTX.Event()
        self.conns, self.procs = [], []
        for k in range(min(procs, s)):
            ids = list(range(k, s, min(procs, s)))
            mine, theirs = CTX.Pipe()
            proc = CTX.Process(target=_subscriber_proc, args=(self.url, ids, p, theirs, self.stop), daemon=True)
            proc.start()
            self.conns.append(mine)
            self.procs.append(proc)
        for c in self.conns:
            if not c.poll(600):
                raise RuntimeError("subscriber process did not start")
            c.recv()
        for c in self.conns:
            c.send("go")

    def requests(self) -> tuple[collections.Counter, collections.Counter, dict]:
        """Calls so far by (op, key kind): the publishers', the subscribers'; subscriber errors."""
        subs, errors = collections.Counter(), collections.Counter()
        for c in self.conns:
            c.send("count")
        for c in self.conns:
            calls, errs = c.recv()
            subs.update(calls)
            errors.update(errs)
        return self.pubs.requests(), subs, dict(errors)

    def churn(self) -> None:
        self.conns[0].send("churn")
        self.conns[0].recv()

    def close(self) -> None:
        self.stop.set()
        for c in self.conns:
            c.send("exit")
        for c, proc in zip(self.conns, self.procs):
            if c.poll(60):
                c.recv()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        self.pubs.close()


class StoreEnv:
    """A store kind: ``fresh()`` gives a URL with nothing in it; ``keys(url)`` counts its keys."""

    def __init__(self, kind: str) -> None:
        self.kind, self._hosts, self._etcd = kind, [], None
        if kind == "etcd":
            from tests.etcd_fixture import EtcdServer

            # data on tmpfs where there is one: requests, not this disk's fsync, are measured
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._dir = tempfile.mkdtemp(prefix="wbridge-cp-etcd-", dir=shm)
            self._etcd = EtcdServer(data_dir=self._dir).start()

    def fresh(self) -> str:
        if self.kind == "tcp":
            host = open_store("tcp://127.0.0.1:0", host_store=True)
            self._hosts.append(host)
            return host.url
        return f"{self._etcd.url}/cp-{uuid.uuid4().hex[:10]}/"

    def keys(self, url: str) -> int:
        if self.kind == "tcp":
            host = next(h for h in self._hosts if h.url == url)
            return int(host._call(lambda st: st.num_keys()))  # noqa: SLF001 - benchmark introspection
        import base64

        import requests

        prefix = "/" + url.split("/", 3)[3]
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        r = requests.post(
            f"{self._etcd.http}/v3/kv/range",
            json={"key": b64(prefix), "range_end": b64(end), "count_only": True},
            timeout=30,
        )
        return int(r.json().get("count", 0))

    def close(self) -> None:
        for h in self._hosts:
            h.close()
        if self._etcd is not None:
            self._etcd.close()
            shutil.rmtree(self._dir, ignore_errors=True)


def measure(env: StoreEnv, p: int, s: int, args) -> dict:
    run = Run(env, p, s, args.procs)
    try:
        run.pubs.publish(args.warmup)
        pubs0, subs0, _ = run.requests()
        commit_ms, round_ms = run.pubs.publish(args.versions)
        pubs1, subs1, errors = run.requests()
    finally:
        run.close()
    pubs, subs = pubs1 - pubs0, subs1 - subs0
    return {
        "requests_per_version": (pubs.total() + subs.total()) / args.versions,
        "breakdown": {"publisher": (pubs, p), "subscriber": (subs, s)},
        "publish_ms": statistics.median(commit_ms),
        "round_ms": statistics.median(round_ms),
        "errors": errors,
    }


def store_size(env: StoreEnv, args) -> tuple[int, int]:
    run = Run(env, args.gc_publishers, 1, 1)
    try:
        run.pubs.publish(10)
        at_10 = env.keys(run.url)
        done = 10
        while done < args.gc_versions:
            n = min(args.churn_every, args.gc_versions - done)
            run.pubs.publish(n, timeout=120.0)
            done += n
            if done < args.gc_versions:
                run.churn()
        time.sleep(1.0)  # not an assertion: lets the last churn subscriber's lease lapse
        run.pubs.publish(1)
        return at_10, env.keys(run.url)
    finally:
        run.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="control_plane", description=__doc__.split("\n")[0])
    ap.add_argument("--publishers", type=int, default=32)
    ap.add_argument("--subscribers", type=int, default=256)
    ap.add_argument("--stores", default="tcp,etcd")
    ap.add_argument("--procs", type=int, default=8, help="subscriber processes")
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gc-publishers", type=int, default=4)
    ap.add_argument("--gc-versions", type=int, default=1000)
    ap.add_argument("--churn-every", type=int, default=100)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="calls per party and version by op and key")
    args = ap.parse_args(argv)
    p, s = args.publishers, args.subscribers
    for kind in args.stores.split(","):
        try:
            env = StoreEnv(kind)
        except FileNotFoundError as e:
            print(f"control_plane: store={kind} skipped ({e})", file=sys.stderr)
            continue
        try:
            one = measure(env, p, 1, args)
            many = measure(env, p, s, args)
            at_10, at_end = store_size(env, args)
        finally:
            env.close()
        if not args.quiet:
            print(
                f"  {kind}: S=1 requests/version={one['requests_per_version']:.0f} "
                f"publish_ms={one['publish_ms']:.1f} round_ms={one['round_ms']:.1f} | S={s} "
                f"requests/version={many['requests_per_version']:.0f} publish_ms={many['publish_ms']:.1f} "
                f"round_ms={many['round_ms']:.1f} publish_ratio={many['publish_ms'] / one['publish_ms']:.2f} "
                f"errors={many['errors'] or one['errors'] or {}}",
                flush=True,
            )
        if args.breakdown:
            for who, (calls, n) in many["breakdown"].items():
                print(f"  {kind} {who}: {calls.total() / args.versions / n:.2f} calls per party and version")
                for (op, key), c in calls.most_common():
                    print(f"    {c / args.versions / n:8.2f}  {op} {key}")
        n = many["requests_per_version"]
        print(
            f"control_plane: store={kind} P={p} S={s} requests_per_version={n:.0f} per_party={n / (p + s):.2f} "
            f"publish_ms={many['publish_ms']:.1f} keys_after_10={at_10} keys_after_{args.gc_versions}={at_end}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
