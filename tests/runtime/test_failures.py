"""Failures give typed errors within their timeouts and never a silent partial update."""

from __future__ import annotations

import re
import time

import pytest

from wbridge import StoreError, Subscriber, open_store

from .actors import PubActor, SubActor
from .harness import Worker, WorkerError, free_port


@pytest.fixture
def store():
    s = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    yield s
    s.close()


@pytest.mark.timeout(60)
def test_wrong_token_is_auth_error(store) -> None:
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, model_kind="tiny")
    try:
        pub.call("publish", 1)
        # register() already reads the channel's signed generation record: refused there
        with pytest.raises(WorkerError) as err:
            Worker("sub", SubActor, store.url, 1, 0, fused=False, model_kind="tiny", token="not-the-token")
        assert err.value.exc_type == "AuthError", err.value
    finally:
        pub.stop()


@pytest.mark.timeout(60)
def test_unknown_tensor_is_plan_error_naming_it(store) -> None:
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, model_kind="tiny")
    sub = Worker(
        "sub",
        SubActor,
        store.url,
        1,
        0,
        fused=False,
        model_kind="tiny",
        extra={"model.layers.9.mlp.not_a_weight": ((4, 4), (4, 4))},
    )
    try:
        pub.call("publish", 1)
        r = sub.call("try_pull", timeout=5.0)
        assert r["error"] == "PlanError", r
        assert "model.layers.9.mlp.not_a_weight" in r["message"]
    finally:
        sub.stop(), pub.stop()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_no_publisher_times_out(store) -> None:
    sub = Worker("sub", SubActor, store.url, 1, 0, fused=False, model_kind="tiny")
    try:
        r = sub.call("try_pull", timeout=2.0)
        assert r["error"] == "WaitTimeout" and "WBridgeError" in r["mro"], r
        # it waited its whole timeout: the pull's own check, or a store call's, found the deadline passed
        assert re.search(r"within 2\.0s \(is a publisher running\?\)|the caller's deadline passed", r["message"]), r
        assert r["elapsed"] < 2.0 + 5.0, r  # and no longer: its timeout plus room for a loaded machine
    finally:
        sub.stop()


@pytest.mark.timeout(30)
def test_unreachable_store_is_store_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreError):
        Subscriber("t", f"tcp://127.0.0.1:{free_port()}", connect_timeout=2.0)
    assert time.monotonic() - t0 < 8.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staged", [False, True])
def test_killed_publisher_fails_the_pull_cleanly(store, staged: bool) -> None:
    # TP=2: the subscriber needs bytes from both ranks; rank 1 dies after publishing v2, so the
    # pull of v2 reads rank 0's part and then fails on rank 1.
    pubs = [Worker(f"pub{r}", PubActor, store.url, r, 2, 2) for r in range(2)]
    sub = Worker("sub", SubActor, store.url, 1, 0, fused=False, staged=staged, transport="tcp")
    try:
        for p in pubs:
            p.send("publish", 1)
        [p.result() for p in pubs]
        assert sub.call("pull", min_version=1)["bad"] == []
        before = sub.call("digest")
        for p in pubs:
            p.send("publish", 2)
        [p.result() for p in pubs]
        pubs[1].kill()
        r = sub.call("try_pull", timeout=10.0)
        assert r["error"] in ("TransportError", "WaitTimeout"), r
        assert r["elapsed"] < 15.0
        if staged:
            assert r["version"] == 1, "staged: the live tensors still hold version 1"
            assert sub.call("digest") == before, "staged: live tensors changed by a failed pull"
            assert sub.call("check", 1) == []
        else:
            assert r["version"] is None, "a failed pull must not claim a complete version"
    finally:
        sub.stop()
        for p in pubs:
            p.stop()


@pytest.mark.timeout(60)
def test_auto_falls_back_to_tcp_when_local_cannot_connect(store) -> None:
    pub = Worker("pub", PubActor, store.url, 0, 1, 1, model_kind="tiny", transport=["tcp", "local"])
    sub = Worker(
        "sub",
        SubActor,
        store.url,
        1,
        0,
        fused=False,
        model_kind="tiny",
        transport="auto",
        fault=("fail-connect", {"only": "local"}),
    )
    try:
        pub.call("publish", 1)
        got = sub.call("pull", min_version=1)
        assert got["bad"] == []
        ((name, reason),) = got["transports"].values()
        assert name == "tcp" and "local" in reason, reason
    finally:
        sub.stop(), pub.stop()
