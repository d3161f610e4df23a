"""A slot reused while a verified pull is still checking it: the pull must retry with a newer
version (``StaleVersionError`` inside ``pull``), as it does when the reuse hits the reads
themselves, and never fail with ``IntegrityError`` nor commit a mix."""

from __future__ import annotations

import pytest

from tests.runtime.harness import Worker, call_all, free_port
from wbridge import Async, Staging

from .actors import FaultPub, FaultSub, release, wait_paused


@pytest.mark.timeout(90)
def test_slot_reused_during_verification_retries(tmp_path) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pubs = [
        Worker(
            f"pub{r}",
            FaultPub,
            url,
            r,
            2,
            2,
            host_store=(r == 0),
            model_kind="tiny",
            mode=Async(max_staleness=100),
            transport="tcp",
            staging=Staging(checksums=True),
        )
        for r in range(2)
    ]
    paused, go = str(tmp_path / "paused"), str(tmp_path / "go")
    # Version 1 is published before the subscriber announces its layout, so its slots are not packed
    # for it: a TP=4 reader reads half of each TP=2 rank's row shards, chunks it covers only in part,
    # which verification re-reads (single-read batches; packed slots are cut at the reader's cells and
    # need none). The first such re-read stops half-way.
    call_all(pubs, "publish", 1)  # slot 1
    fault = ("pause", {"signal_path": paused, "release_path": go, "on_reads": (1,), "max_ops": 1})
    sub = Worker(
        "sub",
        FaultSub,
        url,
        4,
        0,
        fused=False,
        model_kind="tiny",
        transport="tcp",
        verify=True,
        staged=True,
        fault=fault,
    )
    try:
        sub.send("try_pull", timeout=30.0)
        wait_paused(paused, 1)  # reads done, fence checked, verifying
        call_all(pubs, "publish", 2)
        call_all(pubs, "publish", 3)  # slot 1 again, under the verification
        release(go)
        r = sub.result(60)
        assert r["error"] is None, f"a slot reuse during verification failed the pull: {r}"
        assert r["v"] == 3 and sub.call("check", 3) == []
    finally:
        sub.stop()
        for p in pubs:
            p.stop()
