"""What the RL examples share (not an example itself): the plain-vLLM examples' command line,
processes and ``result.json``; every example's wait for its processes' results.

``examples/vllm_async_rl.py`` and ``examples/lora_async_rl.py`` import it, and
``examples/sglang_async_rl.py`` its ``free_port`` and ``next_result``: ``python examples/X.py``
puts ``examples/`` first on ``sys.path``, and the processes it starts inherit that path.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

from wbridge.testing.demo import free_port  # a port below the range the kernel hands out


def command_line(
    doc: str, *, steps: int, interval: float, lr: float, lr_help: str, check_help: str
) -> argparse.Namespace:
    """The options every example takes (``--steps``, ``--interval``, ``--lr``, ``--pause``,
    ``--check``, ``--out``), with an example's defaults and words, parsed; ``doc``: its docstring."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--interval", type=float, default=interval, help="seconds per trainer step (at least)")
    ap.add_argument("--lr", type=float, default=lr, help=lr_help)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds a rollout rests between batches (0: none)")
    ap.add_argument("--check", action="store_true", help=check_help)
    ap.add_argument("--out", default=None, help="write result.json here")
    return ap.parse_args()


def write_result(out_dir: str | None, result: dict) -> None:
    """``result`` as ``out_dir/result.json`` (``--out``); nothing without ``out_dir``."""
    if out_dir:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)


def next_result(results, procs: Sequence, timeout: float) -> tuple:
    """The next item put on ``results`` within ``timeout`` s. A process of ``procs`` that exits with
    an error ends the wait at once (``RuntimeError`` naming it; its traceback is in the output): the
    others would wait for it until their own timeouts (gloo's rendezvous, 30 minutes)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            pass
        failed = [f"{p.name} (exit code {p.exitcode})" for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"{', '.join(failed)} ended with an error; its traceback is above")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no result within {timeout:.0f}s")


def run_procs(trainer: Callable, rollout: Callable, args, timeout: float, train_timeout: float) -> tuple[dict, list]:
    """Run two ``trainer`` and two ``rollout`` processes to the end; return their results. Each forks
    from one server process that imported torch, wbridge and vLLM once (``forkserver``): a process
    spawned afresh imports them itself, about 8 CPU-seconds for a rollout.

    ``trainer(rank, args, where, token, started, results, done)``: ``where`` is (the store's URL,
    the gloo rendezvous' ``init_method``: a file, no port to race for); it puts ``("trainer", rank,
    {"published": [versions], ...})`` on ``results``, then stays until ``done`` is set (rank 0
    hosts the store).
    ``rollout(i, args, store, token, started, stop, last, results)``: generates until ``stop``
    is set, then updates to version ``last.value`` and puts ``("rollout", i, result)``.
    ``started`` is a barrier of all four. ``train_timeout`` bounds the wait for the trainers'
    results, ``timeout`` every other wait; a process that fails ends the run (``next_result``).
    Returns trainer rank 0's result and the rollouts' results.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "wbridge", "vllm.entrypoints.llm", "vllm.v1.engine.async_llm"])
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="wbridge-example-"), "gloo")
    where, token = (f"tcp://127.0.0.1:{free_port()}", f"file://{rendezvous}"), secrets.token_hex(16)
    started, stop, done, last, results = ctx.Barrier(4), ctx.Event(), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    procs = [
        ctx.Process(target=trainer, args=(r, args, where, token, started, results, done), name=f"trainer {r}")
        for r in range(2)
    ]
    procs += [
        ctx.Process(target=rollout, args=(i, args, where[0], token, started, stop, last, results), name=f"rollout {i}")
        for i in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got: dict = {}
        while len(got) < 2:
            kind, i, value = next_result(results, procs, train_timeout)
            got[(kind, i)] = value
        last.value = got[("trainer", 0)]["published"][-1]
        stop.set()
        while len(got) < 4:
            kind, i, value = next_result(results, procs, timeout)
            got[(kind, i)] = value
        done.set()
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(os.path.dirname(rendezvous), ignore_errors=True)
    return got[("trainer", 0)], [got[("rollout", i)] for i in range(2)]
