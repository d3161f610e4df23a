"""Bad input gets a typed error that names the tensor, and nothing is half-applied."""

from __future__ import annotations

import pytest
import torch

from wbridge import LayoutError, PlanError, Publisher, Shard, Subscriber, UsageError, WBridgeError

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
        mode="async",
        max_staleness=100,
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
    with pytest.raises(UsageError, match="max_staleness"):
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
