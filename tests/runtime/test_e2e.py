"""End to end: 4 publisher processes (TP=2 x DP=2), 3 subscribers with other layouts, real store,
real transports. Every pull starts from garbage and must restore every byte."""

from __future__ import annotations

import pytest

import transports

from .actors import PubActor, SubActor
from .harness import Worker, call_all, free_port

TP, DP = 2, 2
E2E_TRANSPORTS = [t for t in ("tcp", "local", "mooncake", "nixl", "nccl") if t in transports.available()]


def start_publishers(url: str, **kwargs) -> list[Worker]:
    pubs = [Worker("pub0", PubActor, url, 0, TP * DP, TP, host_store=True, **kwargs)]
    pubs += [Worker(f"pub{r}", PubActor, url, r, TP * DP, TP, **kwargs) for r in range(1, TP * DP)]
    return pubs


def stop(workers: list[Worker]) -> None:
    for w in reversed(workers):
        w.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", E2E_TRANSPORTS)
def test_three_versions_bit_exact_and_late_joiner(transport: str) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    workers: list[Worker] = []
    try:
        pubs = start_publishers(url, transport=sorted({"tcp", transport}))
        workers += pubs
        subs = [
            Worker("sub-tp0", SubActor, url, 2, 0, transport=transport),
            Worker("sub-tp1", SubActor, url, 2, 1, transport=transport),
            Worker("sub-full", SubActor, url, 1, 0, fused=False, transport=transport),
        ]
        workers += subs
        served: dict[int, int] = {}
        late = None
        for v in (1, 2, 3):
            assert [r["v"] for r in call_all(pubs, "publish", v)] == [v] * 4
            for s in subs + ([late] if late else []):
                got = s.call("pull", min_version=v)
                assert got["v"] == v
                assert got["bad"] == [], f"{s.name} not bit-exact at v{v}: {got['bad'][:3]}"
                assert {name for name, _ in got["transports"].values()} == {transport}
                if s is not late:  # the three original subscribers together need every byte evenly
                    for rank, n in got["bytes_per_source"].items():
                        served[int(rank)] = served.get(int(rank), 0) + n
            if v == 2:
                late = Worker("sub-late", SubActor, url, 2, 1, transport=transport)
                workers.append(late)
                got = late.call("pull")
                assert got["v"] >= 2 and got["bad"] == []
        # reads are spread over the DP replicas: every publisher rank serves within 10% of the others
        loads = [served.get(r, 0) for r in range(TP * DP)]
        assert min(loads) > 0 and max(loads) <= 1.10 * min(loads), loads
    finally:
        stop(workers)


@pytest.mark.timeout(120)
def test_staged_pull_is_bit_exact() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    workers: list[Worker] = []
    try:
        pubs = start_publishers(url)
        workers += pubs
        sub = Worker("sub", SubActor, url, 2, 0, staged=True, transport="tcp")
        workers.append(sub)
        for v in (1, 2):
            call_all(pubs, "publish", v)
            got = sub.call("pull", min_version=v)
            assert got["v"] == v and got["bad"] == []
    finally:
        stop(workers)
