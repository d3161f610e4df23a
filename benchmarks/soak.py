"""Soak: many versions, subscribers killed and restarted at random, every pull checked bit-exactly.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/soak.py`` (or ``wbridge bench soak``); ``--versions``
changes the number of versions (200 by default), ``--seed`` the random kills.

4 publisher processes (TP=2 x DP=2, ``checksums=True``, ``mode="async"``, ``max_staleness=3``,
2 staging slots, serving tcp and local) publish ``--versions`` versions of a synthetic model
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

Counted:
- ``pulls``: pulls that returned a version; ``torn``: those whose bytes do not match the version
  they returned (must be 0);
- ``hangs``: calls (publish or pull) with no answer within their timeout plus a grace (must be 0);
- ``restarts``: subscribers killed and restarted. Pulls that raised are listed by error type.

Last line: ``soak: versions=<n> pulls=<n> torn=<n> hangs=<n> restarts=<n>``; exit status 1 unless
torn=0 and hangs=0.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from multiprocessing.connection import wait
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.runtime.actors import PubActor, SubActor  # noqa: E402
from tests.runtime.harness import Worker, WorkerError, free_port  # noqa: E402

TP, DP = 2, 2
SUBSCRIBERS = (
    dict(tp=2, rank=0, fused=True, staged=False, transport="auto"),
    dict(tp=2, rank=1, fused=True, staged=True, transport="tcp"),
    dict(tp=1, rank=0, fused=False, staged=False, transport="tcp"),
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
        self.versions = self.pulls = self.torn = self.hangs = self.restarts = 0
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

        self.store = open_store(self.url, host_store=True)
        a = self.args
        self.pubs = [
            Worker(
                f"pub{r}",
                PubActor,
                self.url,
                r,
                TP * DP,
                TP,
                model_kind=a.model,
                checksums=True,
                mode="async",
                max_staleness=a.max_staleness,
                slots=2,
                transport=["tcp", "local"],
            )
            for r in range(TP * DP)
        ]
        for i in range(len(SUBSCRIBERS)):
            self.start_sub(i)

    def start_sub(self, i: int) -> None:
        spec = SUBSCRIBERS[i]
        self.generation[i] += 1
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
            verify=True,
            lease_ttl=self.args.lease_ttl,
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
        for w in [*self.subs, *reversed(self.pubs)]:
            if w is not None:
                w.stop()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()

    # -- the event loop ----------------------------------------------------------------------------
    def send(self, w: Worker, method: str, timeout: float, *args: Any, **kwargs: Any) -> None:
        w.send(method, *args, timeout=timeout, **kwargs)
        self.calls[w] = Call(method, timeout)

    def feed_subscribers(self) -> None:
        """Every idle subscriber behind the newest committed version pulls it (or newer)."""
        for i, w in enumerate(self.subs):
            if w in self.calls or self.have[i] >= self.committed:
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
        self.pulls += 1
        self.stale_retries += r["retries"]
        if r["bad"]:
            self.torn += 1
            if len(self.torn_examples) < 5:
                self.torn_examples.append(f"sub{i} v{r['v']}: {r['bad'][:3]}")
        self.have[i] = r["v"]

    def step(self, until: float) -> None:
        """Waits (without spinning) for answers, scheduled kills and hung calls, up to ``until``."""
        now = time.monotonic()
        wake = min([until, *self.kill_at.values(), *(c.deadline for c in self.calls.values())])
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
        self.done_pubs: dict[Worker, Worker] = {}
        for p in self.pubs:
            self.send(p, "publish", self.args.timeout, v)
        while len(self.done_pubs) < len(self.pubs):
            self.feed_subscribers()
            self.step(time.monotonic() + 1.0)
        got = [p.result(0)["v"] for p in self.pubs]
        if got != [v] * len(self.pubs):
            raise RuntimeError(f"publishers returned versions {got} for {v}")
        self.committed = v
        self.versions += 1

    def drain(self) -> None:
        """Lets every subscriber catch up with the last version."""
        deadline = time.monotonic() + self.args.timeout + GRACE
        while any(h < self.committed for h in self.have) and time.monotonic() < deadline:
            self.feed_subscribers()
            self.kill_at.clear()  # no more kills: the run ends with everyone on the last version
            self.step(min(deadline, time.monotonic() + 1.0))

    def run(self) -> None:
        t0 = time.monotonic()
        for v in range(1, self.args.versions + 1):
            self.publish_all(v)
            if v % 20 == 0:
                print(
                    f"soak: v{v} pulls={self.pulls} restarts={self.restarts} ({time.monotonic() - t0:.0f}s)",
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
    args = p.parse_args(argv)
    soak = Soak(args)
    try:
        soak.start()
        soak.run()
    finally:
        soak.stop()
    behind = [f"sub{i}:v{h}" for i, h in enumerate(soak.have) if h < soak.committed]
    print(
        f"soak: {soak.seconds:.1f}s, {args.model} model, stale-version retries inside pulls: "
        f"{soak.stale_retries}, failed pulls: {dict(soak.errors) or 'none'}"
        + (f", behind at the end: {behind}" if behind else "")
    )
    for line in soak.torn_examples:
        print(f"soak: TORN {line}")
    print(
        f"soak: versions={soak.versions} pulls={soak.pulls} torn={soak.torn} hangs={soak.hangs} "
        f"restarts={soak.restarts}",
        flush=True,
    )
    return 0 if soak.torn == 0 and soak.hangs == 0 and not behind else 1


if __name__ == "__main__":
    sys.exit(main())
