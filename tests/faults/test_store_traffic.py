"""Store traffic per version stays O(publishers + subscribers): counted call by call (the control-
plane benchmark's ``CountingStore``) with real publishers and subscribers in several processes on a
real TCPStore and a real etcd.

A sync subscriber's steady state is four calls per version: one batched read of the generation,
its own record, the version record and the slot fences; one blocking wait on the next version's
``ready`` key, which carries that version's record; its reading mark; its ack. Only the aggregating
publisher rank (rank 0) reads subscribers' keys: the other ranks learn the readers' layouts from
one key (``Keys.readers``) and the waits' outcomes from the keys rank 0 writes."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.control_plane import Run, StoreEnv, measure
from tests.etcd_fixture import etcd_binary

P, S, VERSIONS = 3, 6, 6


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_calls_per_version_subscribers_four_and_only_rank0_scans(kind: str) -> None:
    if kind == "etcd" and etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    env = StoreEnv(kind)
    try:
        got = measure(env, P, S, argparse.Namespace(versions=VERSIONS, warmup=2, procs=2))
        assert not got["errors"], got["errors"]
        subs, _ = got["breakdown"]["subscriber"]
        per_sub = subs.total() / (VERSIONS * S)
        assert per_sub <= 4.0, f"{per_sub:.2f} calls per subscriber and version: {dict(subs)}"

        run = Run(env, P, 1, 1)  # per rank this time: which ranks read subscribers' keys
        try:
            run.pubs.publish(2)
            before = [store.calls.copy() for store in run.pubs.stores]
            run.pubs.publish(VERSIONS)
            for rank, (store, old) in enumerate(zip(run.pubs.stores, before)):
                scans = {k: n for k, n in (store.calls - old).items() if "sub/" in k[1]}
                assert (rank == 0) == bool(scans), f"rank {rank} read subscriber keys: {scans}"
        finally:
            run.close()
    finally:
        env.close()
