"""Soak: many versions, subscribers killed and restarted at random, every pull checked bit-exactly.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/soak.py`` (or ``wbridge bench soak``); ``--versions``
changes the number of versions (200 by default), ``--seed`` the random kills.

4 publisher processes (TP=2 x DP=2, ``mode=Async(max_staleness=3)``, ``Staging(slots=2, checksums=True)``,
serving tcp and local) publish ``--versions`` versions of a synthetic model
(``tiny``: 1.5 MiB). 3 subscriber processes pull them with ``verify=True``: TP=2 rank 0 fused
(``auto``: local), TP=2 rank 1 fused and staged (tcp), TP=1 unfused (tcp), each reading from both
DP replicas. The store is hosted by this driver process, outside everything that gets killed.

Whenever a newer version is committed, every idle subscriber is told to pull it; before each pull
its tensors are overwritten with garbage, after it every byte is compared with the values of the
version the pull returned (``synthetic.mismatches``). With probability ``--kill-prob`` a pull is
followed, after a random 0-50 ms, by SIGKILL of that subscriber (usually mid-pull) and a restart
(a new process that registers under a new subscriber id; the dead one's lease lapses after
``--lease-ttl``). Publishers keep going meanwhile: a dead subscriber holds them back at most until
its lease lapses. ``max_staleness`` (3) exceeds the 2 slots, so publishers reuse slots under slow
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
  every data read has a bit flipped (``verify=False``: it serves corrupted bytes, ``--corrupt-relay``).
  The TP=2 rank 1 and the TP=1 subscribers read through the zone (layouts the relays do not have:
  the planner's path over whole relays; the relays read each other's ranges: the same-layout path).
  The corrupting relay's own pulls are counted apart (``corrupt``: its bytes are the fault).
- ``--replays`` of the store losses are replayed generation records: the driver (a store client
  without the token) keeps the channel's signed generation record, puts it back into the emptied
  store before anyone else writes one, and the trainer restarts (every publisher rank killed and
  started again): the new trainer counts versions and epochs from 1 under the old generation.

Counted:
- ``pulls``: pulls that returned a version; ``torn``: those whose bytes do not match the version
  they returned (must be 0); ``stale``: those that returned a version without writing a byte of
  it (the tensors still hold the garbage fill: stale weights reported as success; must be 0);
- ``hangs``: calls (publish or pull) with no answer within their timeout plus a grace (must be 0);
- ``restarts``: subscribers killed and restarted. Pulls that raised are listed by error type.

Last line: ``soak: versions=<n> pulls=<n> torn=<n> hangs=<n> stale=<n> restarts=<n>``; exit status
1 unless torn=0, hangs=0 and stale=0 (and every subscriber holds the last version).
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

from benchmarks._faults import Slowloris, lose_store
from tests.faults.actors import FaultPub
from tests.runtime.actors import SubActor
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
            SubActor,
            self.url,
            spec["tp"],
            spec["rank"],
            fused=spec["fused"],
            staged=spec["staged"],
            transport=spec["transport"],
            model_kind=self.args.model,
            **({"verify": True, "lease_ttl": self.args.lease_ttl} | extra),
        )
        self.have[i] = 0

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
        for w in [*self.subs, *reversed(self.pubs)]:
            if w is not None:
                w.stop()
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
            if w is None or w in self.calls or self.have[i] >= self.committed:
                continue
            self.send(w, "pull", self.args.timeout, min_version=self.have[i] + 1)
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
        elif r["bad"]:
            self.torn += 1
            if len(self.torn_examples) < 5:
                self.torn_examples.append(f"sub{i} v{r['v']}: {r['bad'][:3]}")

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

    def publish_all(self, v: int) -> None:
        """Every rank publishes ``v``; a rank that meets a store still coming back retries."""
        got: dict[Worker, int] = {}
        deadline = time.monotonic() + self.args.timeout
        while len(got) < len(self.pubs):
            self.done_pubs: dict[Worker, Worker] = {}
            todo = [p for p in self.pubs if p not in got]
            for p in todo:
                self.send(p, "publish", self.args.timeout, v)
            while len(self.done_pubs) < len(todo):
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

    def drain(self) -> None:
        """Lets every subscriber catch up with the last version."""
        deadline = time.monotonic() + self.args.timeout + GRACE
        while any(self.have[i] < self.committed for i in self.active()) and time.monotonic() < deadline:
            self.feed_subscribers()
            self.kill_at.clear()  # no more kills: the run ends with everyone on the last version
            self.step(min(deadline, time.monotonic() + 1.0))

    def lose_store(self, replay: bool = False) -> None:
        """The store comes back empty: a new generation, where versions count from 1 again. With
        ``replay``, the old generation record is put back and the trainer restarts: the same
        generation, but versions and epochs count from 1 again all the same."""
        self.thaw()
        self.store = lose_store(self.url, self.store, self.etcd, replay=replay)
        self.store_restarts += 1
        if replay:
            self.replays += 1
            for p in self.pubs:  # the trainer restarts
                self.calls.pop(p, None)
                p.kill()
            self.pubs = [self.start_pub(r) for r in range(TP * DP)]
        self.committed, self.have = 0, [0] * len(SUBSCRIBERS)

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
            self.publish_all(v)
            if step in freezes:
                self.freeze_relay()
            if step in deaths:
                self.kill_replica()
            if step in losses:
                self.lose_store(replay=step in replays)
                v = 0
            if step % 20 == 0:
                print(
                    f"soak: {step} versions, pulls={self.pulls} restarts={self.restarts} "
                    f"({time.monotonic() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
        self.drain()
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
    args = p.parse_args(argv)
    soak = Soak(args)
    try:
        soak.start()
        soak.run()
    finally:
        soak.stop()
    behind = [f"sub{i}:v{soak.have[i]}" for i in soak.active() if soak.have[i] < soak.committed]
    print(
        f"soak: {soak.seconds:.1f}s, {args.model} model, {args.store} store lost {soak.store_restarts}x "
        f"({soak.replays} with its generation record replayed), replicas killed {soak.replica_deaths}x, "
        f"relay frozen {soak.freezes}x, corrupting relay's own pulls {soak.corrupt}, "
        f"slowloris {args.slowloris}/rank, stale-version retries "
        f"inside pulls: {soak.stale_retries}, failed calls: {dict(soak.errors) or 'none'}"
        + (f", behind at the end: {behind}" if behind else "")
    )
    for line in soak.torn_examples:
        print(f"soak: TORN {line}")
    print(
        f"soak: versions={soak.versions} pulls={soak.pulls} torn={soak.torn} hangs={soak.hangs} "
        f"stale={soak.stale} restarts={soak.restarts}",
        flush=True,
    )
    return 0 if soak.torn == 0 and soak.hangs == 0 and soak.stale == 0 and not behind else 1


if __name__ == "__main__":
    sys.exit(main())
