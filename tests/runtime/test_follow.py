"""The engines' follower (``wbridge.integrations.follow.Watcher``, run by the vLLM workers and the
SGLang scheduler processes) on a real channel, with no engine: a trainer process publishes; the
subscriber and its watcher run here, each pull on a thread of its own as a vLLM worker's
background pull.

- It starts a pull as soon as a version is committed, none while that pull is staged, the next
  at once on the commit's poke, and stops with the error when its subscriber is closed under it.
- The store is lost (its host, the trainer, dies) and a new trainer publishes v1, v2 in a new
  store on the same address, below the v3 the watcher held: it pulls the new v2.
- A deterministic error (the trainer publishes bf16, the rollout registered fp32: ``PlanError``)
  stops it at once, logged once; transient ones (corrupted reads, ``IntegrityError``) are
  retried with a doubling backoff, counted in ``retries``.
- An exception from ``start`` (``RuntimeError: can't start new thread``) ends it with the error kept.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from wbridge import IntegrityError, PlanError, UsageError
from wbridge.integrations.follow import Watcher
from wbridge.testing.faults import inject, wrapper

from .fit_actors import Fp32Trainer, master
from .harness import Worker, free_port
from .test_framework_fit import _rollout


class Rollout:
    """A watcher over ``sub`` whose pulls run on threads of their own (as a vLLM worker's): what
    they pulled goes to ``pulled``; ``commit()`` stands for the engine's commit."""

    def __init__(self, sub, **watcher) -> None:
        self.sub, self.held, self.staged = sub, 0, False
        self.pulled: queue.Queue = queue.Queue()
        self.times: list[float] = []
        self.w = Watcher(sub.wait_version, self.floor, self.start, **watcher)

    def floor(self) -> int | None:
        return None if self.staged else self.held

    def start(self, v: int) -> bool:
        self.staged = True
        self.times.append(time.monotonic())
        threading.Thread(target=self._pull, args=(v,), daemon=True).start()
        return True

    def _pull(self, v: int) -> None:
        try:
            got = self.sub.pull(min_version=v, timeout=20)
        except Exception as e:  # noqa: BLE001 - handed to the watcher, as a worker's pull does
            self.staged = False
            self.w.failed(e)
            self.pulled.put(e)
            return
        self.w.succeeded()
        self.pulled.put((v, got))

    def commit(self, v: int) -> None:
        self.held, self.staged = v, False
        self.w.poke()


@contextlib.contextmanager
def trainer(**kwargs) -> Iterator[tuple[Worker, str]]:
    """A trainer process publishing bf16 from fp32 masters, hosting the store; and its URL."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp", **kwargs)
    try:
        yield pub, url
    finally:
        pub.stop()


def _exact(tensors: dict, v: int) -> bool:
    return all(torch.equal(tensors[n], t if n == "steps" else t.to(torch.bfloat16)) for n, t in master(v).items())


@pytest.mark.timeout(90)
def test_watcher_starts_each_pull_when_a_version_is_committed() -> None:
    with trainer() as (pub, url):
        sub, tensors = _rollout(url)
        r = Rollout(sub, give_up_s=20, slice_s=0.5)
        r.w.start()
        with sub:
            pub.call("publish", 1)
            assert r.pulled.get(timeout=20) == (1, 1), "the watcher starts the pull of a new version"
            assert _exact(tensors, 1)
            pub.call("publish", 2)
            time.sleep(1.0)
            assert r.pulled.empty() and r.w.started == 1, "no second pull while one is staged"
            t0 = time.monotonic()
            r.commit(1)
            assert r.pulled.get(timeout=20) == (2, 2)
            print(f"\nv2 pull started {time.monotonic() - t0:.3f}s after the commit of v1 (then pulled)")
            r.commit(2)
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while r.w.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not r.w.alive and isinstance(r.w.error, UsageError), r.w.error  # its subscriber was closed
        r.w.close()
        r.w.close()  # idempotent


@pytest.mark.timeout(120)
def test_watcher_follows_a_new_store_generation() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp")
    try:
        sub, tensors = _rollout(url)
        r = Rollout(sub, give_up_s=60, slice_s=0.5)
        r.w.start()
        with sub:
            for v in (1, 2, 3):
                pub.call("publish", v)
                assert r.pulled.get(timeout=20) == (v, v)
                r.commit(v)
            # the store's host dies with the store; a new trainer hosts a new one at the same address
            pub.kill()
            pub = Worker("trainer-new", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp")
            t0 = time.monotonic()
            assert pub.call("publish", 11) == 1  # (its weights: master(11) and master(12))
            assert pub.call("publish", 12) == 2
            got = None
            while time.monotonic() - t0 < 60:
                try:
                    item = r.pulled.get(timeout=max(0.1, 60 - (time.monotonic() - t0)))
                except queue.Empty:
                    break
                if isinstance(item, tuple):
                    got = item[1]
                    r.commit(got)
                    if got == 2 and _exact(tensors, 12):
                        break
            print(f"\nafter the store loss: pulled v{got} in {time.monotonic() - t0:.2f}s, {r.w}")
            assert got == 2 and _exact(tensors, 12), (got, r.w)
            assert r.w.alive and r.w.error is None
        r.w.close()
    finally:
        pub.stop()


@pytest.mark.timeout(90)
def test_deterministic_errors_stop_at_once_transient_ones_back_off(caplog) -> None:
    with trainer() as (pub, url):  # (checksums by default: what verify=True checks)
        # fp32 tensors against a bf16 publisher: the plan cannot be made, on any try
        wrong, _ = _rollout(url, dtype=torch.float32)
        caplog.set_level(logging.DEBUG, logger="wbridge.integrations.follow")
        r = Rollout(wrong, give_up_s=30, slice_s=0.5)
        r.w.start()
        t0 = time.monotonic()
        pub.call("publish", 1)
        err = r.pulled.get(timeout=20)
        while r.w.alive and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        took = time.monotonic() - t0
        print(f"\ndeterministic: {type(err).__name__} stopped the watcher {took:.2f}s after the publish: {err}")
        assert isinstance(err, PlanError) and r.w.error is err and not r.w.alive
        assert r.w.started == 1 and r.w.retries == 0 and took < 2.0
        time.sleep(1.0)
        assert r.pulled.empty(), "nothing retried"
        stopped = [m for m in caplog.messages if "watcher stopped" in m]
        assert len(stopped) == 1 and "PlanError" in stopped[0], caplog.messages
        wrong.close()

        # the first reads larger than the stamps come corrupted (two or three pulls fail, as a pull
        # may read a chunk it holds in part again), then clean ones: each failed pull retried
        # after a backoff that doubles from 0.2 s
        sub, tensors = _rollout(url, verify=True)
        inject(sub, wrapper("flip-bit", on_reads=(1, 2, 3), min_bytes=64))
        r = Rollout(sub, give_up_s=30, slice_s=0.5, backoff=(0.2, 5.0))
        r.w.start()
        with sub:
            got = [r.pulled.get(timeout=20)]
            while not isinstance(got[-1], tuple):
                got.append(r.pulled.get(timeout=20))
            gaps = [b - a for a, b in zip(r.times, r.times[1:])]
            print(f"transient: {[type(g).__name__ for g in got]}; starts {[round(g, 2) for g in gaps]} s apart")
            failed = got[:-1]
            assert len(failed) >= 2 and all(isinstance(g, IntegrityError) for g in failed) and got[-1] == (1, 1)
            assert _exact(tensors, 1) and r.w.retries == len(failed) and r.w.alive and r.w.error is None
            assert all(gap >= 0.2 * 2**i for i, gap in enumerate(gaps)), gaps
        r.w.close()


@pytest.mark.timeout(60)
def test_an_exception_that_ends_the_watcher_is_kept() -> None:
    with trainer() as (pub, url):
        sub, _ = _rollout(url)

        def start(v: int) -> bool:
            raise RuntimeError("can't start new thread")

        w = Watcher(sub.wait_version, lambda: 0, start, give_up_s=20, slice_s=0.5)
        w.start()
        with sub:
            pub.call("publish", 1)
            deadline = time.monotonic() + 20
            while w.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            print(f"\n{w}: {w.error!r}")
            assert not w.alive and isinstance(w.error, RuntimeError) and "new thread" in str(w.error)
