"""Integrity: checksummed versions catch bytes corrupted in flight; a slot reused under a slow
reader never yields a torn version."""

from __future__ import annotations

import pytest

from wbridge import Async, Staging

from .actors import PubActor, SubActor
from .harness import Worker, call_all, free_port


def publishers(url: str, n: int, **kwargs) -> list[Worker]:
    return [Worker(f"pub{r}", PubActor, url, r, n, n, host_store=(r == 0), **kwargs) for r in range(n)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fused", [True, False])
def test_verify_accepts_a_clean_pull(fused: bool) -> None:
    # TP=2 publishers, a TP=2 fused subscriber reads parts of chunks (column-split o_proj and
    # down_proj), so verification also re-reads partly covered chunks.
    url = f"tcp://127.0.0.1:{free_port()}"
    pubs = publishers(url, 2, staging=Staging(checksums=True))
    sub = Worker("sub", SubActor, url, 2 if fused else 1, 0, fused=fused, verify=True, transport="tcp")
    try:
        call_all(pubs, "publish", 1)
        got = sub.call("pull", min_version=1)
        assert got["v"] == 1 and got["bad"] == []
    finally:
        sub.stop()
        [p.stop() for p in reversed(pubs)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staged", [False, True])
def test_bit_flipped_in_flight_is_integrity_error(staged: bool) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pubs = publishers(url, 2, staging=Staging(checksums=True))
    # the 2nd data batch is corrupted: the first pull (one batch: every byte this TP rank needs,
    # replicated norms included, is read from publisher rank 1, the one holding its shard) is
    # clean; batches under 1 KiB (version stamps) are not counted
    sub = Worker(
        "sub",
        SubActor,
        url,
        2,
        1,
        verify=True,
        staged=staged,
        transport="tcp",
        fault=("flip-bit", {"on_reads": (2,), "min_bytes": 1024}),
    )
    try:
        call_all(pubs, "publish", 1)
        assert sub.call("pull", min_version=1)["bad"] == []
        before = sub.call("digest")
        call_all(pubs, "publish", 2)
        r = sub.call("try_pull", timeout=10.0)
        assert r["error"] == "IntegrityError", r
        if staged:
            assert r["version"] == 1 and sub.call("digest") == before
        else:
            assert r["version"] is None
        # the next pull (no fault now) fetches everything again and is exact
        got = sub.call("pull", min_version=2)
        assert got["v"] == 2 and got["bad"] == []
    finally:
        sub.stop()
        [p.stop() for p in reversed(pubs)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_slot_reused_under_a_slow_reader_is_never_torn() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    (pub,) = publishers(url, 1, mode=Async(max_staleness=10), staging=Staging(slots=2))
    # the first read finishes, then the reader stalls 3 s while the publisher reuses its slot
    sub = Worker("sub", SubActor, url, 2, 0, transport="tcp", fault=("slow", {"delay": 3.0}))
    try:
        pub.call("publish", 1)
        sub.send("pull", min_version=1)
        pub.call("wait_reader", 1)
        pub.call("publish", 2)
        pub.call("publish", 3)  # slot of version 1 again
        got = sub.result(60)
        assert got["v"] == 3, got["v"]
        assert got["retries"] >= 1
        assert got["bad"] == [], "a pull across a slot reuse must not commit a torn version"
    finally:
        sub.stop(), pub.stop()
