"""Soak: many versions, subscribers killed and restarted at random, every pull checked bit-exactly.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/soak.py`` (or ``wbridge bench soak``); ``--versions``
changes the number of versions (200 by default), ``--seed`` the random kills.

4 publisher processes (TP=2 x DP=2, ``mode=Async(max_staleness=3)``, ``Staging(slots=2, checksums=True)``,
serving tcp and local) publish ``--versions`` versions of a synthetic model
(``tiny``: 1.5 MiB). 3 subscriber processes pull them with ``verify=True``: TP=2 rank 0 fused
(``auto``: local), TP=2 rank 1 fused and staged (tcp), TP=1 unfused (tcp), each reading from both
DP replicas. The store is hosted by this driver process, outside everything that gets killed.
Each store history (the versions between two store losses, counted from 1) publishes other
weights: version ``v`` of the ``k``-th history holds the synthetic values of ``v + offset * k``
(``offset`` 1000 up to 999 versions), so no two histories share a byte.

Whenever a newer version is committed, every idle subscriber is told to pull it; before each pull
its tensors are overwritten with garbage, after it every byte is compared with the values of the
version the pull returned, in the history it came from (``_faults.content_of``). With probability
``--kill-prob`` a pull is followed, after a random 0-50 ms, by SIGKILL of that subscriber (usually
mid-pull) and a restart (a new process that registers under a new subscriber id; the dead one's
lease lapses after ``--lease-ttl``). Publishers keep going meanwhile: a dead subscriber holds them
back at most until its lease lapses. ``max_staleness`` (3) exceeds the 2 slots, so publishers reuse slots under slow
readers: a ``StaleVersionError`` retry inside the pull (counted as "stale-version retries"), never a
torn read (the slot stamps read from the publishers' memory after the data catch it, and a reuse
during verification is staleness too, not an ``IntegrityError``).

Faults beyond the subscriber kills, spread evenly over the run:
- ``--store-restarts`` times the store is lost and comes back empty at a version boundary (the
  driver closes the TCPStore it hosts and hosts a fresh one on the same port; with ``--store etcd``
  etcd is killed, its data directory wiped, and it restarts). Calls in flight fail with
  ``StoreError`` and are retried; publishers and subscribers find the new store generation, join
  it, and version numbers start again at 1 there (a pull in flight across the loss asked for a
  version number of the old store: it reads the newest of the new one instead).
- ``--replica-deaths`` times a publisher rank (never rank 0) is SIGKILLed right after a commit, while
  subscribers pull that version: they read the dead rank's bytes from its DP replica. Once they
  hold it, the rank is restarted and every rank registers again (a new epoch).
- ``--slowloris`` connections per publisher rank trickle a byte a second into its tcp server and
  never authenticate (reconnecting when closed), for the whole run.
- Relays of zone ``z`` (tcp, staged): a good one, one that is frozen (SIGSTOP) ``--frozen-relay``
  times for ``--freeze-s`` seconds (its lease outlives that: it still looks alive), and one whose
  every data read has a bit flipped (``verify=False``: it serves corrupted bytes); ``--relays 0``
  runs without them. The TP=2 rank 1 and the TP=1 subscribers read through the zone (layouts the
  relays do not have: the planner's path over whole relays; the relays read each other's ranges:
  the same-layout path). The corrupting relay's own pulls are counted apart (``corrupt``: its
  bytes are the fault).
- ``--replays`` of the store losses are same-epoch trainer restarts under a replayed generation
  record: the trainer dies (every publisher rank killed), the driver (a store client without the
  token) keeps the channel's signed generation record and puts it back into the emptied store before
  anyone else writes one (subscribers and watchers are stopped, SIGSTOP, until it is back), and the
  trainer restarts and registers until it is at the epoch number the old one had reached: the same
  generation, the same store keys and epoch, versions from 1 again, other weights. Meanwhile the
  driver keeps every version's checksum records (``v/<v>/sum/<rank>``, signed for that very key),
  and for ``--sum-replays`` versions of the new history (every other one, never the last of the run)
  puts the old history's records back over the new ones once the version is committed, before any
  subscriber is told to pull it; then every subscriber pulls it: a verifying one must refuse the
  records (``IntegrityError``, a failed call) or be bit-exact. The genuine records are put back
  after that round (the attacker leaves), so that a subscriber restarted meanwhile, which holds
  nothing newer, is not left unable to catch up (the publishers would wait on it: a denial of
  service the threat model grants this attacker).
- ``--watchers`` processes (2) stand in for engines' watchers: a registered subscriber (TP=2 rank 0
  fused over ``auto``; TP=1 unfused, staged, verifying, over tcp) whose own thread waits for a
  version above the one it holds (``wait_version``) and pulls it, never told to by the driver, across
  every store loss. Each pull is logged with the content it left, and checked as the subscribers'
  are; at the end each must hold the last version, bit-exactly.

Counted:
- ``pulls``: pulls that returned a version, the subscribers' and the watchers'; ``torn``: those
  whose bytes are no history's values of the version they returned (must be 0); ``stale``: those
  that returned a version without writing a byte of it (the tensors still hold the garbage fill),
  or with an older history's values of it although a newer history had committed a version before
  the pull was asked for (a watcher's: before it began): stale weights reported as success (must be 0);
- ``hangs``: calls (publish or pull, a watcher's included) with no answer within their timeout plus
  a grace (must be 0);
- ``restarts``: subscribers killed and restarted. Calls that raised are listed by error type
  (``watcher ...`` for the watchers').

Last line: ``soak: versions=<n> pulls=<n> torn=<n> hangs=<n> stale=<n> restarts=<n> watchers=<k>/<n>``
(``k``: watchers holding the last version bit-exactly); exit status 1 unless torn=0, hangs=0 and
stale=0 and every subscriber and watcher holds the last version.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Any

from benchmarks._faults import WATCH_WAIT_S, Replayer, Slowloris, SoakSub, Watcher, lose_store
from tests.faults.actors import FaultPub
from tests.runtime.harness import Worker, WorkerError, call_all, free_port
from wbridge import Async, Staging, Zone

TP, DP = 2, 2
ZONE = "z"
RELAY_TTL = 10.0  # a relay's lease: longer than a freeze, so a frozen relay still looks alive
FLIP = ("flip-bit", {"on_reads": range(1, 100_000), "min_bytes": 1024})  # every data read it makes
SUBSCRIBERS = (
    dict(tp=2, rank=0, fused=True, staged=False, transport="auto"),
    dict(tp=2, rank=1, fused=True, staged=True, transport="tcp", zone=Zone(ZONE)),
    dict(tp=1, rank=0, fused=False, staged=False, transport="tcp", zone=Zone(ZONE)),
    dict(tp=1, rank=0, fused=False, staged=True, transport="tcp", zone=Zone(ZONE, relay=True), role="relay"),
    dict(tp=1, rank=0, fused=False, staged=True, transport="tcp", zone=Zone(ZONE, relay=True), role="frozen"),
    dict(tp=1, rank=0, fused=False, staged=True, transport="tcp", zone=Zone(ZONE, relay=True), role="corrupt"),
)
# watchers: engines' stand-ins that follow versions by themselves (``_faults.Watcher``)
WATCHERS = (
    dict(tp=2, rank=0, fused=True, staged=False, transport="auto"),
    dict(tp=1, rank=0, fused=False, staged=True, transport="tcp", verify=True),
)
GRACE = 15.0  # beyond a call's own timeout before it counts as a hang


class Call:
    """One call in flight on a worker: what, since when, and when it counts as hung."""

    def __init__(self, method: str, timeout: float) -> None:
        self.method, self.started = method, time.monotonic()
        self.deadline = self.started + timeout + GRACE


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.url = f"tcp://127.0.0.1:{free_port()}"
        self.versions = self.pulls = self.torn = self.hangs = self.restarts = self.stale = 0
        self.store_restarts = self.replica_deaths = self.replays = self.freezes = self.corrupt = 0
        self.thaw_at: tuple[int, float] | None = None  # (pid, when) of the frozen relay
        self.etcd = None
        self.slowloris: Slowloris | None = None
        self.stale_retries = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.torn_examples: list[str] = []
        self.pubs: list[Worker] = []
        self.subs: list[Worker | None] = [None] * len(SUBSCRIBERS)
        self.have: list[int] = [0] * len(SUBSCRIBERS)  # newest version each subscriber holds
        self.calls: dict[Worker, Call] = {}
        self.kill_at: dict[int, float] = {}  # subscriber index -> monotonic time
        self.generation = [0] * len(SUBSCRIBERS)
        self.committed = 0
        # store histories: each counts versions from 1; version v of history k has content
        # v + offset * k, so histories never share bytes
        self.offset = 1000 * (1 + args.versions // 1000)
        self.history = 0
        self.since = [0.0]  # by history: when its first version was committed (time.time())
        self.sent_in = [0] * len(SUBSCRIBERS)  # the history each subscriber's pull was asked in
        self.refused_at = [0] * len(SUBSCRIBERS)  # refused this version's checksums: wait for a newer one
        self.replayer = Replayer(TP * DP)
        self.spy: Any = None  # a store client without the token (etcd; the hosted store for tcp)
        self.replaying = False  # this history has the old one's generation record and key names
        self.sums_replayed = 0  # versions whose checksum records were put back from the old history
        self.same_epoch: list[int] = []  # the epoch each same-epoch restart began at
        self.watchers: list[Worker] = []
        self.watch_have: list[tuple[int, int | None]] = []  # newest (version, content) each pulled
        self.watch_hung: set[int] = set()
        self.watch_pulls = 0
        self.watch_final: list[dict] = []
        self.watch_behind: list[str] = []

    # -- processes --------------------------------------------------------------------------------
    def start(self) -> None:
        from wbridge import open_store

        if self.args.store == "etcd":
            from tests.etcd_fixture import EtcdServer

            self.etcd = EtcdServer().start()
            self.url, self.store = self.etcd.url + "/soak/", None
        else:
            self.store = open_store(self.url, host_store=True)
        self.pubs = [self.start_pub(r) for r in range(TP * DP)]
        for i in self.active():
            self.start_sub(i)
        for j in range(self.args.watchers):
            self.watchers.append(self.start_watcher(j))
            self.watch_have.append((0, None))
        if self.args.slowloris:
            self.slowloris = Slowloris(self.url, TP * DP, self.args.slowloris)

    def start_pub(self, r: int) -> Worker:
        a = self.args
        return Worker(
            f"pub{r}",
            FaultPub,
            self.url,
            r,
            TP * DP,
            TP,
            model_kind=a.model,
            mode=Async(max_staleness=a.max_staleness),
            staging=Staging(slots=2, checksums=True),
            transport=["tcp", "local"],
        )

    def active(self) -> list[int]:
        """The subscribers this run has (relays only with ``--relays``)."""
        return [i for i, s in enumerate(SUBSCRIBERS) if self.args.relays or "role" not in s]

    def start_sub(self, i: int) -> None:
        spec = SUBSCRIBERS[i]
        self.generation[i] += 1
        extra: dict[str, Any] = {}
        if "zone" in spec and self.args.relays:
            extra["zone"] = spec["zone"]
        if spec.get("role") in ("relay", "frozen", "corrupt"):
            extra["lease_ttl"] = RELAY_TTL
        if spec.get("role") == "corrupt":
            extra |= dict(fault=FLIP, verify=False)
        self.subs[i] = Worker(
            f"sub{i}.{self.generation[i]}",
            SoakSub,
            self.url,
            spec["tp"],
            spec["rank"],
            fused=spec["fused"],
            staged=spec["staged"],
            transport=spec["transport"],
            model_kind=self.args.model,
            offset=self.offset,
            histories=self.args.store_restarts + 1,
            **({"verify": True, "lease_ttl": self.args.lease_ttl} | extra),
        )
        self.have[i] = 0

    def start_watcher(self, j: int) -> Worker:
        spec = WATCHERS[j % len(WATCHERS)]
        return Worker(
            f"watch{j}",
            Watcher,
            self.url,
            spec["tp"],
            spec["rank"],
            fused=spec["fused"],
            model_kind=self.args.model,
            offset=self.offset,
            histories=self.args.store_restarts + 1,
            pull_timeout=self.args.timeout,
            staged=spec["staged"],
            transport=spec["transport"],
            verify=spec.get("verify", False),
            lease_ttl=self.args.lease_ttl,
        )

    def kill_sub(self, i: int) -> None:
        w = self.subs[i]
        self.calls.pop(w, None)
        self.kill_at.pop(i, None)
        w.kill()
        self.restarts += 1
        self.start_sub(i)

    def stop(self) -> None:
        self.thaw()
        if self.slowloris is not None:
            self.slowloris.close()
        for w in [*self.subs, *self.watchers, *reversed(self.pubs)]:
            if w is not None:
                w.stop()
        if self.spy is not None and self.spy is not getattr(self, "store", None):
            self.spy.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
        if self.etcd is not None:
            self.etcd.close()

    # -- the event loop ----------------------------------------------------------------------------
    def send(self, w: Worker, method: str, timeout: float, *args: Any, **kwargs: Any) -> None:
        w.send(method, *args, timeout=timeout, **kwargs)
        self.calls[w] = Call(method, timeout)

    def feed_subscribers(self) -> None:
        """Every idle subscriber behind the newest committed version pulls it (or newer)."""
        for i, w in enumerate(self.subs):
            if w is None or w in self.calls or self.have[i] >= self.committed or self.refused_at[i] >= self.committed:
                continue
            self.send(w, "pull", self.args.timeout, min_version=self.have[i] + 1, history=self.history)
            self.sent_in[i] = self.history
            if self.rng.random() < self.args.kill_prob:
                self.kill_at[i] = time.monotonic() + self.rng.uniform(0.0, 0.05)

    def on_sub_answer(self, i: int, w: Worker) -> None:
        del self.calls[w]
        try:
            r = w.result(0)
        except WorkerError as e:
            self.errors[e.exc_type] += 1
            if self.errors[e.exc_type] == 1:  # the first of each kind, for the record
                print(f"soak: sub{i} pull failed: {str(e).strip().splitlines()[-1]}", file=sys.stderr, flush=True)
            if e.exc_type == "IntegrityError":  # (checksum records put back): asked again for a newer version
                self.refused_at[i] = self.committed
            return
        self.have[i] = r["v"]
        if SUBSCRIBERS[i].get("role") == "corrupt":  # its own bytes are the fault
            self.corrupt += 1
            return
        self.pulls += 1
        self.stale_retries += r["retries"]
        if r["untouched"]:
            self.stale += 1
            print(f"soak: STALE sub{i} reported v{r['v']} without writing it", file=sys.stderr, flush=True)
        elif r["content"] is None:
            self.torn += 1
            if len(self.torn_examples) < 5:
                self.torn_examples.append(f"sub{i} v{r['v']}: {r['bad'][:3]}")
        elif self.history_of(r["v"], r["content"]) < self.sent_in[i]:
            self.stale += 1
            print(
                f"soak: STALE sub{i} returned v{r['v']} of history {self.history_of(r['v'], r['content'])}, "
                f"asked in history {self.sent_in[i]}",
                file=sys.stderr,
                flush=True,
            )

    def history_of(self, v: int, content: int) -> int:
        return (content - v) // self.offset

    def poll_watchers(self) -> None:
        """Checks the watchers' pulls since the last poll: each must hold what the version it
        returned was in its history (else torn), and a pull that began after a newer history's
        first commit must not return an older history's content (stale). A call running longer
        than its timeouts and a grace counts as a hang (once)."""
        for j, w in enumerate(self.watchers):
            st = w.call("state", call_timeout=30.0)
            for v, content, began in st["pulls"]:
                self.pulls += 1
                self.watch_pulls += 1
                self.watch_have[j] = (v, content)
                if content is None:
                    self.torn += 1
                    if len(self.torn_examples) < 5:
                        self.torn_examples.append(f"watch{j} v{v}")
                    continue
                k = self.history_of(v, content)
                if any(t <= began for t in self.since[k + 1 :]):
                    self.stale += 1
                    print(f"soak: STALE watch{j} returned v{v} of history {k} after a newer one", file=sys.stderr)
            if st["busy_s"] > self.args.timeout + WATCH_WAIT_S + GRACE and j not in self.watch_hung:
                self.watch_hung.add(j)
                self.hangs += 1
                print(f"soak: HANG watch{j} after {st['busy_s']:.1f}s", file=sys.stderr, flush=True)

    def watchers_done(self) -> bool:
        final = (self.committed, self.committed + self.offset * self.history)
        return all(h == final for h in self.watch_have)

    def step(self, until: float) -> None:
        """Waits (without spinning) for answers, scheduled kills and hung calls, up to ``until``."""
        now = time.monotonic()
        thaw = [self.thaw_at[1]] if self.thaw_at else []
        wake = min([until, *thaw, *self.kill_at.values(), *(c.deadline for c in self.calls.values())])
        # Worker keeps its pipe private; waiting on all of them at once is what this loop needs.
        conns = {w._conn: w for w in self.calls}  # noqa: SLF001
        for conn in wait(list(conns), timeout=max(0.0, wake - now)):
            w = conns[conn]
            if w in self.subs:
                self.on_sub_answer(self.subs.index(w), w)
            else:
                self.calls.pop(w, None)  # a publisher's answer: collected by publish_all
                self.done_pubs[w] = w
        now = time.monotonic()
        if self.thaw_at and self.thaw_at[1] <= now:
            self.thaw()
        for i, when in list(self.kill_at.items()):
            if when <= now:
                self.kill_sub(i)
        for w, c in list(self.calls.items()):
            if c.deadline <= now:
                self.hangs += 1
                print(f"soak: HANG {w.name}.{c.method} after {now - c.started:.1f}s", file=sys.stderr, flush=True)
                if w in self.subs:
                    self.kill_sub(self.subs.index(w))
                else:
                    raise RuntimeError(f"publisher {w.name} hung in {c.method}")

    def publish_all(self, v: int, feed: bool = True) -> None:
        """Every rank publishes ``v``; a rank that meets a store still coming back retries.
        Meanwhile subscribers are told to pull (``feed``)."""
        got: dict[Worker, int] = {}
        deadline = time.monotonic() + self.args.timeout
        content = v + self.offset * self.history
        while len(got) < len(self.pubs):
            self.done_pubs: dict[Worker, Worker] = {}
            todo = [p for p in self.pubs if p not in got]
            for p in todo:
                self.send(p, "publish", self.args.timeout, content)
            while len(self.done_pubs) < len(todo):
                if feed:
                    self.feed_subscribers()
                self.step(time.monotonic() + 1.0)
            for p in todo:
                try:
                    got[p] = p.result(0)["v"]
                except WorkerError as e:
                    if e.exc_type != "StoreError" or time.monotonic() > deadline:
                        raise
                    self.errors[f"publish {e.exc_type}"] += 1
            if len(got) < len(self.pubs):
                time.sleep(0.2)
        if list(got.values()) != [v] * len(self.pubs):
            raise RuntimeError(f"publishers returned versions {list(got.values())} for {v}")
        self.committed = v
        self.versions += 1
        if len(self.since) == self.history:
            self.since.append(time.time())  # the new history's first commit
        self.replayer.keep(self.store_client(), v)

    def store_client(self) -> Any:
        """The driver's store client without the token (it hosts the tcp store)."""
        if self.store is not None:
            return self.store
        if self.spy is None:
            from wbridge import open_store

            self.spy = open_store(self.url, connect_timeout=10.0)
        return self.spy

    def settle(self) -> None:
        """Lets every subscriber pull the newest committed version (or refuse it), until none is
        pulling; kills, restarts and hangs go on meanwhile."""
        deadline = time.monotonic() + self.args.timeout + GRACE
        while time.monotonic() < deadline:
            self.feed_subscribers()
            if not any(w in self.calls for w in self.subs if w is not None):
                break
            self.step(min(deadline, time.monotonic() + 1.0))

    def drain(self) -> None:
        """Lets every subscriber catch up with the last version (the watchers by themselves)."""
        deadline = time.monotonic() + self.args.timeout + GRACE
        self.refused_at = [0] * len(SUBSCRIBERS)
        while time.monotonic() < deadline:
            self.poll_watchers()
            if all(self.have[i] >= self.committed for i in self.active()) and self.watchers_done():
                break
            self.feed_subscribers()
            self.kill_at.clear()  # no more kills: the run ends with everyone on the last version
            self.step(min(deadline, time.monotonic() + 1.0))

    def finish_watchers(self) -> list[str]:
        """Stops the watchers; those that do not hold the last version bit-exactly, as text."""
        behind = []
        final = self.committed + self.offset * self.history
        for j, w in enumerate(self.watchers):
            st = w.call("finish", call_timeout=self.args.timeout + 30.0)
            self.watch_final.append(st)
            for name, n in st["errors"].items():
                self.errors[f"watcher {name}"] += n
            if (st["v"], st["content"]) != (self.committed, final) or not st["stopped"]:
                behind.append(f"watch{j}:v{st['v']}" + ("" if st["content"] == final else f"(content {st['content']})"))
        return behind

    def lose_store(self, replay: bool = False) -> None:
        """The store comes back empty: a new generation, where versions count from 1 again. With
        ``replay``, the trainer dies, the old generation record is put back, and the trainer
        restarts at the epoch number the old one had reached (it registers again until it is
        there): the same generation and epoch, versions counted from 1 again, other weights. The
        subscribers and watchers are stopped (SIGSTOP) while the store is down and until the record
        is back, so none of them writes a generation record of its own first."""
        self.thaw()
        stopped: list[int] = []
        if replay:
            epoch = self.pubs[0].call("epoch", call_timeout=self.args.timeout)
            for p in self.pubs:  # the trainer dies
                self.calls.pop(p, None)
                p.kill()
            stopped = [w.proc.pid for w in [*self.subs, *self.watchers] if w is not None and w.proc.is_alive()]
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
        if self.spy is not None:
            self.spy.close()
            self.spy = None
        try:
            self.store = lose_store(self.url, self.store, self.etcd, replay=replay)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        self.store_restarts += 1
        self.history += 1
        self.replayer.history_lost()
        self.replaying = replay
        if replay:
            self.replays += 1
            self.pubs = [self.start_pub(r) for r in range(TP * DP)]  # the trainer restarts
            while self.pubs[0].call("epoch", call_timeout=self.args.timeout) < epoch:
                call_all(self.pubs, "reregister", call_timeout=self.args.timeout)
            self.same_epoch.append(epoch)
        self.committed, self.have = 0, [0] * len(SUBSCRIBERS)
        self.refused_at = [0] * len(SUBSCRIBERS)

    def replays_sums(self, v: int) -> bool:
        """Whether the checksum records of ``v`` are put back from the lost history: after a
        same-epoch restart, every other version, up to ``--sum-replays``."""
        return (
            self.replaying
            and v % 2 == 0
            and self.sums_replayed < self.args.sum_replays
            and self.replayer.can_replay(self.store_client(), v)
        )

    def publish_replayed(self, v: int) -> None:
        """Publishes ``v`` while no subscriber pulls (each holds the version before, or refused
        it), then the store client without the token puts the old history's checksum records of
        ``v`` back over the new history's before any subscriber is told to pull it, and all of
        them pull it before the next version: verifying readers must refuse them
        (``IntegrityError``) or be bit-exact. (Watchers follow by themselves: they race the replay.)"""
        self.settle()  # (none is then so far behind that the publishers wait for it)
        self.publish_all(v, feed=False)
        self.replayer.replay(self.store_client(), v)
        self.sums_replayed += 1
        self.settle()  # every subscriber pulls v now, before a newer version is committed
        # the attacker goes away: with the genuine records back, those that refused v (a
        # subscriber restarted meanwhile holds nothing newer) can pull it, so no publisher waits
        # on them past max_staleness (a denial of service the threat model grants the attacker)
        self.replayer.restore(self.store_client(), v)
        self.refused_at = [0] * len(SUBSCRIBERS)

    def freeze_relay(self) -> None:
        """SIGSTOP the relay to freeze, for ``--freeze-s`` (pulls go on meanwhile)."""
        i = next(k for k, s in enumerate(SUBSCRIBERS) if s.get("role") == "frozen")
        pid = self.subs[i].proc.pid
        os.kill(pid, signal.SIGSTOP)
        self.thaw_at = (pid, time.monotonic() + self.args.freeze_s)
        self.freezes += 1

    def thaw(self) -> None:
        if self.thaw_at is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.thaw_at[0], signal.SIGCONT)
            self.thaw_at = None

    def kill_replica(self) -> None:
        """A publisher rank dies while subscribers pull the version just committed; once they hold
        it (from its replica), it restarts and every rank registers again."""
        victim = 1 + self.replica_deaths % (TP * DP - 1)  # never rank 0
        self.calls.pop(self.pubs[victim], None)
        self.pubs[victim].kill()
        self.replica_deaths += 1
        self.drain()
        self.pubs[victim] = self.start_pub(victim)  # registers
        call_all([p for r, p in enumerate(self.pubs) if r != victim], "reregister", call_timeout=self.args.timeout)

    def run(self) -> None:
        t0 = time.monotonic()
        n, a = self.args.versions, self.args
        losses = {n * (k + 1) // (a.store_restarts + 1) for k in range(a.store_restarts)}
        deaths = {n * (2 * k + 1) // (2 * a.replica_deaths + 2) for k in range(a.replica_deaths)} - losses
        replays = set(sorted(losses)[: a.replays])
        frozen = a.frozen_relay if a.relays else 0
        freezes = {n * (2 * k + 1) // (2 * frozen) + 1 for k in range(frozen)} - losses - deaths
        v = 0
        for step in range(1, n + 1):
            v += 1
            if step < n and self.replays_sums(v):  # (the last version stays pullable)
                self.publish_replayed(v)
            else:
                self.publish_all(v)
            if step in freezes:
                self.freeze_relay()
            if step in deaths:
                self.kill_replica()
            if step in losses:
                self.lose_store(replay=step in replays)
                v = 0
            if step % 20 == 0:
                self.poll_watchers()
                print(
                    f"soak: {step} versions, pulls={self.pulls} restarts={self.restarts} "
                    f"({time.monotonic() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        self.drain()
        self.watch_behind = self.finish_watchers()
        self.seconds = time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=200)
    p.add_argument("--kill-prob", type=float, default=0.08, help="chance that a pull is followed by a kill")
    p.add_argument("--lease-ttl", type=float, default=2.0)
    p.add_argument(
        "--max-staleness",
        type=int,
        default=3,
        help="above the 2 slots, so slots get reused under slow readers (fence retries)",
    )
    p.add_argument("--model", choices=["tiny", "small"], default="tiny")
    p.add_argument("--timeout", type=float, default=60.0, help="timeout of every publish and pull")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", choices=["tcp", "etcd"], default="tcp", help="etcd: a throwaway local etcd")
    p.add_argument("--store-restarts", type=int, default=2, help="times the store is lost (comes back empty)")
    p.add_argument("--replica-deaths", type=int, default=2, help="publisher ranks killed mid-pull, then restarted")
    p.add_argument("--slowloris", type=int, default=64, help="unauthenticated trickling connections per rank")
    p.add_argument("--relays", type=int, choices=[0, 1], default=1, help="1: zone relays (good, frozen, corrupting)")
    p.add_argument("--frozen-relay", type=int, default=2, help="times the frozen relay is stopped (SIGSTOP)")
    p.add_argument("--freeze-s", type=float, default=6.0, help="how long each freeze lasts")
    p.add_argument("--replays", type=int, default=1, help="store losses that put the old generation record back")
    p.add_argument(
        "--sum-replays",
        type=int,
        default=4,
        help="versions after a replay whose checksum records are put back from the lost history",
    )
    p.add_argument(
        "--watchers", type=int, choices=range(len(WATCHERS) + 1), default=2, help="engine stand-ins (wait_version)"
    )
    args = p.parse_args(argv)
    soak = Soak(args)
    try:
        soak.start()
        soak.run()
    finally:
        soak.stop()
    behind = [f"sub{i}:v{soak.have[i]}" for i in soak.active() if soak.have[i] < soak.committed]
    behind += soak.watch_behind
    on_final = len(soak.watchers) - len(soak.watch_behind)
    print(
        f"soak: {soak.seconds:.1f}s, {args.model} model, {args.store} store lost {soak.store_restarts}x "
        f"({soak.replays} with its generation record replayed), replicas killed {soak.replica_deaths}x, "
        f"relay frozen {soak.freezes}x, corrupting relay's own pulls {soak.corrupt}, "
        f"slowloris {args.slowloris}/rank, same-epoch restarts at epochs {soak.same_epoch}, "
        f"checksum records of a lost history put back for {soak.sums_replayed} versions, "
        f"watchers on the final version {on_final}/{len(soak.watchers)} ({soak.watch_pulls} pulls), "
        f"stale-version retries inside pulls: {soak.stale_retries}, failed calls: {dict(soak.errors) or 'none'}"
        + (f", behind at the end: {behind}" if behind else "")
    )
    for line in soak.torn_examples:
        print(f"soak: TORN {line}")
    print(
        f"soak: versions={soak.versions} pulls={soak.pulls} torn={soak.torn} hangs={soak.hangs} "
        f"stale={soak.stale} restarts={soak.restarts} watchers={on_final}/{len(soak.watchers)}",
        flush=True,
    )
    return 0 if soak.torn == 0 and soak.hangs == 0 and soak.stale == 0 and not behind else 1


if __name__ == "__main__":
    sys.exit(main())
