"""Bad input gets a typed error that names the tensor, and nothing is half-applied."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from wbridge import (
    Async,
    Delta,
    LayoutError,
    PlanError,
    Publisher,
    Shard,
    Staging,
    Subscriber,
    UsageError,
    WBridgeError,
    Zone,
)

from .harness import free_port

G = (8, 6)


@pytest.fixture
def pub():
    p = Publisher(
        "bad",
        f"tcp://127.0.0.1:{free_port()}",
        host_store=True,
        token="t",
        transport="tcp",
        mode=Async(max_staleness=100),
    )
    p.register(
        {
            "w": (torch.arange(48, dtype=torch.bfloat16).reshape(G), Shard("w", G)),
            "n": (torch.ones(6, dtype=torch.float32), Shard("n", (6,))),
        }
    )
    p.publish(timeout=10)
    yield p
    p.close()


def subscriber(pub: Publisher, tensors: dict) -> Subscriber:
    sub = Subscriber("bad", pub.store_url, token="t", transport="tcp")
    sub.register(tensors)
    return sub


@pytest.mark.timeout(60)
def test_non_contiguous_tensor_is_layout_error_naming_it(pub) -> None:
    t = torch.zeros(6, 8, dtype=torch.bfloat16).t()
    with pytest.raises(LayoutError, match="'w'.*not contiguous"):
        Subscriber("bad", pub.store_url, token="t").register({"w": (t, Shard("w", G))})
    with pytest.raises(LayoutError, match="'w'"):
        Publisher("bad2", pub.store_url, transport="tcp").register({"w": (t, Shard("w", G))})


@pytest.mark.timeout(60)
def test_shape_mismatch_is_plan_error_naming_the_tensor(pub) -> None:
    dst = torch.full((9, 6), 7, dtype=torch.bfloat16)
    sub = subscriber(pub, {"w": (dst, Shard("w", (9, 6)))})
    with pytest.raises(PlanError, match="w"):
        sub.pull(timeout=10)
    assert sub.version is None
    assert torch.equal(dst, torch.full((9, 6), 7, dtype=torch.bfloat16)), "bytes moved before validation"
    sub.close()


@pytest.mark.timeout(60)
def test_dtype_mismatch_is_plan_error_naming_the_tensor(pub) -> None:
    dst = torch.zeros(6, dtype=torch.bfloat16)  # the publisher has float32
    sub = subscriber(pub, {"n": (dst, Shard("n", (6,)))})
    with pytest.raises(PlanError, match="n"):
        sub.pull(timeout=10)
    assert torch.count_nonzero(dst) == 0
    sub.close()


@pytest.mark.timeout(60)
def test_out_of_order_calls_are_usage_errors(pub) -> None:
    p = Publisher("bad3", pub.store_url, transport="tcp")
    with pytest.raises(UsageError, match="before register"):
        p.publish(timeout=1)
    p.close()
    p.close()  # idempotent
    with pytest.raises(UsageError, match="closed"):
        p.register({"w": (torch.zeros(G), Shard("w", G))})
    s = Subscriber("bad", pub.store_url, token="t")
    with pytest.raises(UsageError, match="before register"):
        s.pull(timeout=1)
    s.close()
    with pytest.raises(UsageError, match=r"write mode=Async\(max_staleness=k\)"):
        Publisher("bad4", pub.store_url, mode="async")
    with pytest.raises(WBridgeError, match="declaration"):
        Subscriber("bad", pub.store_url, token="t").register({"w": torch.zeros(G)})


@pytest.mark.timeout(60)
def test_pull_async_and_good_path(pub) -> None:
    import asyncio

    dst = torch.zeros(G, dtype=torch.bfloat16)
    sub = subscriber(pub, {"w": (dst, Shard("w", G))})
    v = asyncio.run(sub.pull_async(timeout=10))
    assert v == sub.version == sub.latest() == 1
    assert torch.equal(dst, torch.arange(48, dtype=torch.bfloat16).reshape(G))
    assert "version=1" in repr(sub) and "registered" in repr(pub)
    sub.close()


NAN, INF = float("nan"), float("inf")


def _bad_calls(pub: Publisher, sub: Subscriber, url: str) -> dict[str, Callable[[], object]]:
    """Every public entry point with bad arguments; each must raise a ``WBridgeError``."""
    import asyncio

    from wbridge import Flat, Fused, Stack, open_store

    w = torch.zeros(G, dtype=torch.bfloat16)
    ok = Shard("w", G)
    return {
        "Publisher(channel='')": lambda: Publisher("", url),
        "Publisher(channel='a/b')": lambda: Publisher("a/b", url),
        "Publisher(channel=3)": lambda: Publisher(3, url),
        "Publisher(rank='0')": lambda: Publisher("x", url, rank="0"),
        "Publisher(world_size=0)": lambda: Publisher("x", url, world_size=0),
        "Staging(slots=1.5)": lambda: Staging(slots=1.5),
        "Publisher(connect_timeout=nan)": lambda: Publisher("x", url, connect_timeout=NAN),
        "Publisher(connect_timeout=-1)": lambda: Publisher("x", url, connect_timeout=-1),
        "Async(max_staleness='2')": lambda: Async(max_staleness="2"),
        "Staging(checksums='no')": lambda: Staging(checksums="no"),
        "Delta(history=2**63)": lambda: Delta(history=2**63),
        "Publisher(staging=True)": lambda: Publisher("x", url, staging=True),
        "Publisher(mode='fast')": lambda: Publisher("x", url, mode="fast"),
        "Publisher(host_store='no')": lambda: Publisher("x", url, host_store="no"),
        "Subscriber(verify=2)": lambda: Subscriber("x", url, verify=2),
        "Subscriber(zone='east')": lambda: Subscriber("x", url, zone="east"),
        "Zone(relay='no')": lambda: Zone("east", relay="no"),
        "Zone('x' * 100000)": lambda: Zone("x" * 100_000),
        "Publisher(token=5)": lambda: Publisher("x", url, token=5),
        "Publisher(store=5)": lambda: Publisher("x", 5),
        "Subscriber(channel='')": lambda: Subscriber("", url),
        "Subscriber(lease_ttl=0)": lambda: Subscriber("x", url, lease_ttl=0),
        "Subscriber(lease_ttl=nan)": lambda: Subscriber("x", url, lease_ttl=NAN),
        "Subscriber(connect_timeout='3')": lambda: Subscriber("x", url, connect_timeout="3"),
        "Subscriber(token=5)": lambda: Subscriber("x", url, token=5),
        "open_store(5)": lambda: open_store(5),
        "open_store(port='x')": lambda: open_store("tcp://127.0.0.1:notaport"),
        "open_store(connect_timeout=-1)": lambda: open_store(url, connect_timeout=-1),
        "Shard(offsets=(-1, 0))": lambda: Shard("w", G, (-1, 0)),
        "Shard(offsets=(1.5, 0))": lambda: Shard("w", G, (1.5, 0)),
        "Shard(global_shape='ab')": lambda: Shard("w", "ab"),
        "Shard(name=5)": lambda: Shard(5, G),
        "Fused(dim='x')": lambda: Fused("x", (ok,)),
        "Fused(parts=5)": lambda: Fused(0, 5),
        "Stack(parts=5)": lambda: Stack(5),
        "Flat(segments=5)": lambda: Flat(5),
        "Flat(start='x')": lambda: Flat((("w", G, "x", 1),)),
        "register('abc')": lambda: pub.register("abc"),
        "register(None)": lambda: pub.register(None),
        "register({w: tensor})": lambda: pub.register({"w": w}),
        "register({w: (5, Shard)})": lambda: pub.register({"w": (5, ok)}),
        "sub.register([])": lambda: sub.register([]),
        "publish(timeout=nan)": lambda: pub.publish(timeout=NAN),
        "publish(timeout=-1)": lambda: pub.publish(timeout=-1),
        "publish(timeout=inf)": lambda: pub.publish(timeout=INF),
        "publish(timeout='3')": lambda: pub.publish(timeout="3"),
        "publish_async(timeout=nan)": lambda: pub.publish_async(timeout=NAN),
        "wait_acked('1')": lambda: pub.wait_acked("1"),
        "wait_acked(timeout=nan)": lambda: pub.wait_acked(1, timeout=NAN),
        "pull(min_version='3')": lambda: sub.pull(min_version="3"),
        "pull(min_version=1.5)": lambda: sub.pull(min_version=1.5),
        "pull(min_version=-1)": lambda: sub.pull(min_version=-1),
        "pull(timeout=nan)": lambda: sub.pull(timeout=NAN),
        "pull(timeout=-1)": lambda: sub.pull(timeout=-1),
        "pull_async(min_version='3')": lambda: asyncio.run(sub.pull_async(min_version="3")),
        "pull_async(timeout=nan)": lambda: asyncio.run(sub.pull_async(timeout=NAN)),
    }


@pytest.mark.timeout(120)
def test_every_entry_point_types_its_errors(pub) -> None:
    dst = torch.zeros(G, dtype=torch.bfloat16)
    sub = subscriber(pub, {"w": (dst, Shard("w", G))})
    wrong = {}
    try:
        for what, call in _bad_calls(pub, sub, pub.store_url).items():
            try:
                got = call()
            except WBridgeError:
                continue
            except BaseException as e:  # noqa: BLE001 - the point: anything else is a finding
                wrong[what] = f"{type(e).__name__}: {e}"[:120]
                continue
            if hasattr(got, "close"):
                got.close()
            wrong[what] = f"no error (returned {got!r:.60})"
        assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())
        # a huge but finite timeout is a valid one (it overflowed a lock's timeout before)
        assert sub.pull(timeout=1e12) == 1 and pub.wait_acked(1, timeout=1e12) is None
        assert pub.publish(timeout=1e12) == 2
    finally:
        sub.close()


@pytest.mark.timeout(60)
def test_deeply_nested_store_record_is_store_error(pub) -> None:
    from wbridge import StoreError, open_store
    from wbridge.protocol import generation
    from wbridge.protocol.channel import ChannelStore
    from wbridge.protocol.keys import Keys

    dst = torch.zeros(G, dtype=torch.bfloat16)
    sub = subscriber(pub, {"w": (dst, Shard("w", G))})
    store = open_store(pub.store_url)
    try:
        keys = Keys("bad", generation.current(ChannelStore(store, Keys("bad"), b"t")))
        good = store.get(keys.version)
        store.set(keys.version, b"[" * 100_000 + b"]" * 100_000)
        with pytest.raises(StoreError, match="malformed"):
            sub.pull(timeout=5)
        store.set(keys.version, good)
        assert sub.pull(timeout=5) == 1
    finally:
        store.close()
        sub.close()
