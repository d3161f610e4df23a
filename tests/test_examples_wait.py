"""The RL examples end as soon as one of their processes fails (``examples/_rl.py``'s
``next_result``) rather than waiting out the others' timeouts: a trainer rank that died in its
rendezvous once held its peer, the engines and the example for the test's whole 560 s."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run from examples/, as ``python examples/X.py`` runs: ``_rl`` imports from there.
SCRIPT = """
import multiprocessing as mp, sys, time
from _rl import next_result

def fail():
    raise SystemExit(3)

def hold(q):
    time.sleep(float(sys.argv[1]))
    q.put(("rollout", 0, "late"))

if __name__ == "__main__":
    ctx = mp.get_context("fork")  # (spawn cannot import functions of a -c script)
    q = ctx.Queue()
    procs = [ctx.Process(target=hold, args=(q,), name="rollout 0")]
    if sys.argv[2] == "fail":
        procs.append(ctx.Process(target=fail, name="trainer 1"))
    for p in procs:
        p.start()
    t0 = time.monotonic()
    try:
        print("result", next_result(q, procs, 120)[2])
    except RuntimeError as e:
        print("error", e)
    print(f"waited {time.monotonic() - t0:.1f}")
    for p in procs:
        p.kill()
"""


def run(hold_s: float, how: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(hold_s), how],
        cwd=os.path.join(ROOT, "examples"), env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.timeout(200)
def test_a_process_that_fails_ends_the_wait_at_once_naming_it() -> None:
    out = run(60.0, "fail")
    assert "error trainer 1 (exit code 3) ended with an error" in out, out
    assert float(out.split("waited ")[1]) < 30.0, out


@pytest.mark.timeout(200)
def test_results_still_arrive_while_every_process_is_alive() -> None:
    t0 = time.monotonic()
    out = run(2.0, "ok")
    assert "result late" in out, out
    assert time.monotonic() - t0 < 120.0
