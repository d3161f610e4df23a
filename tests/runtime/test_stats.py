"""``pub.stats`` and ``sub.stats`` have one shape: ``last``, ``history`` and totals that agree with it."""

from __future__ import annotations

import pytest
import torch

from wbridge import Publisher, Shard, Subscriber

from .harness import free_port

G = (64, 32)


@pytest.mark.timeout(60)
def test_publisher_and_subscriber_stats_share_last_history_and_totals() -> None:
    w = torch.zeros(G, dtype=torch.float32)
    url = f"tcp://127.0.0.1:{free_port()}"
    with Publisher("stats", url, host_store=True, token="t", transport="tcp", mode="sync") as pub:
        assert pub.stats.last is None and pub.stats.count == 0 and len(pub.stats.history) == 0
        pub.register({"w": (w, Shard("w", G))})
        dst = torch.full(G, -1.0)
        with Subscriber("stats", url, token="t", transport="tcp") as sub:
            sub.register({"w": (dst, Shard("w", G))})
            assert sub.stats.last is None and sub.stats.count == 0
            for i in range(3):
                w.fill_(i)
                fut = pub.publish_async(timeout=20)
                assert sub.pull(min_version=i + 1, timeout=20) == i + 1
                assert fut.result(timeout=20) == i + 1
                assert torch.equal(dst, w)
            for stats, version in ((pub.stats, 3), (sub.stats, 3)):
                assert stats.last is stats.history[-1] and stats.last.version == version
                assert [s.version for s in stats.history] == [1, 2, 3]
                assert stats.count == 3
                assert stats.nbytes == sum(s.nbytes for s in stats.history) > 0
                assert stats.seconds == pytest.approx(sum(s.seconds for s in stats.history))
                assert stats.seconds > 0
            assert pub.stats.stall_s == pytest.approx(sum(s.stall_s for s in pub.stats.history))
            assert pub.stats.wait_s == pytest.approx(sum(s.wait_s for s in pub.stats.history))
            assert sub.stats.retries == sum(s.retries for s in sub.stats.history)
            assert sub.stats.deltas == 0 and sub.stats.plans >= 1
            assert pub.stats.last.nbytes == w.numel() * 4 and sub.stats.last.nbytes == w.numel() * 4
