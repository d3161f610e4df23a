"""Layout adapters through the real runtime: Megatron-style publishers (TP=1 x EP=2, dense layers
replicated on both ranks) in two processes, rollout subscribers whose layouts are traced from a
vLLM-style loader (TP=2 x EP=2, fused qkv/gate_up, stacked experts, padded vocabulary) pulling
over TCP; garbage-filled before each pull, bit-exact against the engine's own load_weights."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from wbridge import Subscriber
from wbridge.integrations.trace import trace_load_weights

from .engines import VllmStyleModel, hf_shapes
from .helpers import free_port, garbage_fill, mapped_mask, to_numpy
from .test_trace import MOE, full_weights, reference_engine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_megatron_publishers_to_traced_vllm_style_subscribers(tmp_path):
    port, world, versions = free_port(), 2, 2
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "runtime_roles.py"),
                str(r),
                str(world),
                str(port),
                str(tmp_path),
                "1",
                "2",
                str(versions),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    subs = []
    try:
        rollouts = []
        for r in range(2):
            m = VllmStyleModel(MOE, tp=2, rank=r, ep=2)
            entries = trace_load_weights(m, m.load_weights, hf_shapes(MOE)).bind(m)
            sub = Subscriber("corr", f"tcp://127.0.0.1:{port}", token="corr-token", transport="tcp", connect_timeout=60)
            subs.append(sub)
            rollouts.append((m, entries))
        deadline = time.monotonic() + 60
        while True:  # the store is up once rank 0's publisher exists
            try:
                for sub, (_, entries) in zip(subs, rollouts):
                    sub.register(entries)
                break
            except Exception:  # noqa: BLE001 - store not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for v in range(1, versions + 1):
            open(tmp_path / f"want{v}", "w").close()
            for r, (sub, (_m, entries)) in enumerate(zip(subs, rollouts)):
                garbage_fill(entries)
                got = sub.pull(min_version=v, timeout=60.0)
                assert got >= v
                ref = reference_engine(MOE, full_weights(MOE, seed=got), tp=2, rank=r, ep=2)
                refp = dict(ref.named_parameters())
                for name, (t, decl) in entries.items():
                    base, _, idx = name.partition("#")
                    want = refp[base][int(idx)] if idx else refp[base]
                    mask = mapped_mask(name, t, decl)
                    a, b = to_numpy(t).reshape(-1), to_numpy(want).reshape(-1)
                    assert np.array_equal(a[mask].view(np.uint32), b[mask].view(np.uint32)), f"v{v} rank {r}: {name}"
                    assert (a.view(np.uint8).reshape(-1, 4)[~mask] == 0x5A).all(), f"{name}: padding written"
    finally:
        for s in subs:
            s.close()
        open(tmp_path / "done", "w").close()
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=30)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0].decode(errors="replace"))
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
