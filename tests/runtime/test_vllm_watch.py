"""The vLLM workers' channel watcher (``wbridge.integrations.vllm.watch``) on a real channel, with
no vLLM: a trainer process publishes; the watcher starts a pull as soon as a version is committed
(nobody asks), starts none while that pull is staged, starts the next at once on the commit's
poke, and stops with the error when its subscriber is closed under it."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from wbridge import UsageError
from wbridge.integrations.vllm.watch import Watcher

from .fit_actors import Fp32Trainer, master
from .harness import Worker, free_port
from .test_framework_fit import _rollout


@pytest.mark.timeout(90)
def test_watcher_starts_each_pull_when_a_version_is_committed() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp")
    try:
        sub, tensors = _rollout(url)
        held = {"v": 0, "staged": False}  # what a worker's kernels hold; whether a pull is staged
        pulled: queue.Queue = queue.Queue()

        def start(v: int) -> None:  # as wbridge_pull_start: the pull on a thread of its own
            held["staged"] = True
            threading.Thread(target=lambda: pulled.put((v, sub.pull(min_version=v, timeout=20)))).start()

        w = Watcher(sub.wait_version, lambda: None if held["staged"] else held["v"], start, give_up_s=20, slice_s=0.5)
        with sub:
            pub.call("publish", 1)
            assert pulled.get(timeout=20) == (1, 1), "the watcher starts the pull of a new version"
            assert torch.equal(tensors["w"], master(1)["w"].to(torch.bfloat16))
            pub.call("publish", 2)
            time.sleep(1.0)
            assert pulled.empty() and w.started == 1, "no second pull while one is staged"
            t0 = time.monotonic()
            held.update(v=1, staged=False)  # the commit of v1 ...
            w.poke()  # ... pokes the watcher
            assert pulled.get(timeout=20) == (2, 2)
            print(f"\nv2 pull started {time.monotonic() - t0:.3f}s after the commit of v1 (then pulled)")
            held.update(v=2, staged=False)
            w.poke()
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while w.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not w.alive and isinstance(w.error, UsageError), w.error  # its subscriber was closed
        w.close()
        w.close()  # idempotent
    finally:
        pub.stop()
