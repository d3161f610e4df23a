"""Shared fixtures and markers. ``gpu`` tests skip where no CUDA device exists.

Every process of the suite runs one OpenMP thread (``OMP_NUM_THREADS=1``, set here before anything
imports torch, so the workers and every process they start inherit it; a value the caller set
wins). The suite runs many processes on few cores, and torch's idle OpenMP threads spin between
its parallel regions: ``tests/runtime`` took 217 CPU-seconds with torch's default threads and 100
with one thread each (141 s and 81 s of wall time under ``-n 6`` on 2 cores).

``heavy`` tests (real vLLM/SGLang engines, Ray, multi-process training) run ``HEAVY_AT_ONCE`` at a
time under ``pytest -n N`` (``scripts/test.sh``); one keeps about one core busy. On these 2 cores,
two at once once left the other workers' tests too little CPU (timing-bound tests failed at load
14); since the examples' rollouts rest between batches and SGLang's idle schedulers sleep instead
of spinning a core each, two lanes fit (a run of 2026-12-05, per-worker CPU accounting: the lanes
held 340 and 290 CPU-seconds of tests and ended 542 and 555 s after the first test started, the
other workers 543-568 s). Their modules are split into that many lanes of about equal length
(``HEAVY_SECONDS``); each lane heads one worker's share of the collection (work-stealing
scheduling hands each worker a contiguous share and moves tests from the end of a long queue to an
idle worker; ours never moves a heavy test), so each lane runs on one worker, its module fixtures
once (a module engine started once); a lock with ``HEAVY_AT_ONCE`` slots shared by the run's
workers holds back any heavy test that lands elsewhere all the same. (``xdist_group`` would say
this directly, but xdist 3.8 cannot rename pytest 9's node ids, so ``--dist loadgroup`` ignores
the groups.)"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
import uuid

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # see the module docstring


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


HEAVY_AT_ONCE = 2
# About how long each heavy module takes in a suite run on these 2 cores (s: the sum of its tests'
# setup, call and teardown, beside the other workers; clean-clone CI of 2026-12-05): balances the
# lanes. A module not listed counts HEAVY_DEFAULT_SECONDS.
HEAVY_SECONDS = {
    "tests/correspondence/test_sglang_engine.py": 198,
    "tests/correspondence/test_vllm_engine.py": 130,
    "tests/correspondence/test_ray.py": 103,
    "tests/correspondence/test_sglang_example.py": 101,
    "tests/correspondence/test_vllm_faults.py": 87,
    "tests/correspondence/test_lora_example.py": 87,
    "tests/correspondence/test_vllm_lora.py": 73,
    "tests/correspondence/test_vllm_async_rl.py": 62,
    "tests/correspondence/test_sglang_lora.py": 57,
    "tests/correspondence/test_dtensor.py": 54,
    "tests/correspondence/test_vllm_updater.py": 50,
    "tests/correspondence/test_vllm_trainer_driven.py": 41,
    "tests/correspondence/test_lora_channel.py": 39,
}
HEAVY_DEFAULT_SECONDS = 30


def _lanes(heavy: list) -> list[list]:
    """The heavy items in ``HEAVY_AT_ONCE`` lanes of about equal estimated time, a module's items
    together and in collection order (longest modules first, each into the shortest lane)."""
    modules: dict[str, list] = {}
    for item in heavy:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    lanes: list[list] = [[] for _ in range(HEAVY_AT_ONCE)]
    seconds = [0] * HEAVY_AT_ONCE
    for name in sorted(modules, key=lambda m: -HEAVY_SECONDS.get(m, HEAVY_DEFAULT_SECONDS)):
        i = seconds.index(min(seconds))
        lanes[i] += modules[name]
        seconds[i] += HEAVY_SECONDS.get(name, HEAVY_DEFAULT_SECONDS)
    return lanes


def _heavy_ids_file(run: str) -> str:
    """Where the workers of run ``run`` leave the node ids of its heavy tests for the scheduler."""
    return os.path.join(tempfile.gettempdir(), f"wbridge-heavy-{run}.ids")


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex  # the scheduler's and the workers' (xdist passes it on)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and config.getoption("testrunuid", None) is not None:
        try:
            os.unlink(_heavy_ids_file(config.option.testrunuid))
        except FileNotFoundError:
            pass


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the shares below count what runs
def pytest_collection_modifyitems(config, items):
    heavy = [item for item in items if item.get_closest_marker("heavy") is not None]
    run = getattr(config, "workerinput", {}).get("testrunuid")
    if run is not None:
        with open(_heavy_ids_file(run) + f".{os.getpid()}", "w") as f:
            json.dump([item.nodeid for item in heavy], f)
        os.replace(f.name, _heavy_ids_file(run))  # whole, as every worker writes the same list
    light = [item for item in items if item.get_closest_marker("heavy") is None]
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    first, second = (_lanes(heavy) + [[]])[:2]
    # the work-stealing scheduler's first two shares (pytest_xdist_make_scheduler)
    share = len(items) // workers
    second_share = (len(items) - share) // max(1, workers - 1)
    fill = share - len(first)
    if workers >= 2 and 0 <= fill <= len(light) and len(second) <= second_share:
        items[:] = first + light[:fill] + second + light[fill:]
    else:
        items[:] = heavy + light
    if not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` (``--dist load``) schedules by work stealing that never moves a heavy test: each
    worker starts on a contiguous share of the collection, the order ``pytest_collection_modifyitems``
    makes (a heavy lane heads each of the first two shares)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler.worksteal import MIN_PENDING, WorkStealingScheduling

    class KeepHeavy(WorkStealingScheduling):
        """Work stealing as xdist's, but an idle worker takes only the light tests at the end of
        another's queue: a heavy module stays on its lane's worker, its module fixtures set up once."""

        heavy: frozenset[str] | None = None

        def _light_tail(self, pending: list[int]) -> int:
            if self.heavy is None:
                with open(_heavy_ids_file(config.option.testrunuid)) as f:
                    self.heavy = frozenset(json.load(f))
            n = 0
            for i in reversed(pending):
                if self.collection[i] in self.heavy:
                    break
                n += 1
            return min(n, max(0, len(pending) - MIN_PENDING))

        def check_schedule(self) -> None:
            up = {node: pending for node, pending in self.node2pending.items() if not node.shutting_down}
            idle = [node for node, pending in up.items() if len(pending) < MIN_PENDING]
            if not idle:
                return
            if self.pending:
                for i, node in enumerate(idle):
                    self._send_tests(node, len(self.pending) // (len(idle) - i))
                idle = [node for node, pending in up.items() if len(pending) < MIN_PENDING]
                if not idle:
                    return
            if self.steal_requested_from_node is not None:
                return
            tails = {node: self._light_tail(pending) for node, pending in up.items()}
            victim = max(tails, key=tails.__getitem__, default=None)
            n = 0 if victim is None else min(tails[victim], max(1, len(up[victim]) // 2))
            if n == 0:
                for node in idle:  # nothing to take: they run what they hold and stop
                    node.shutdown()
                return
            victim.send_steal(up[victim][-n:])
            self.steal_requested_from_node = victim

    return KeepHeavy(config, log)


def _heavy_slot(run: str):
    """An open file holding one of the run's ``HEAVY_AT_ONCE`` locks (waits for a free one)."""
    while True:
        for slot in range(HEAVY_AT_ONCE):
            f = open(os.path.join(tempfile.gettempdir(), f"wbridge-heavy-{run}-{slot}.lock"), "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f
            except BlockingIOError:
                f.close()
        time.sleep(0.5)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout: waiting is not the test's time
def pytest_runtest_protocol(item, nextitem):
    run = getattr(item.config, "workerinput", {}).get("testrunuid")
    if run is None or item.get_closest_marker("heavy") is None:
        yield
        return
    with _heavy_slot(run):
        yield
