"""Deltas in a channel that looks like a deployment: two publisher ranks with ``delta=True`` and
subscribers of three reader layouts (whole tensors; a row slice that stalls past its lease and
joins again; column halves that join at version 6), each new set of layouts a new packing
generation of the publishers' slots. About 3% of the bf16 elements change per version. Every
pull after a subscriber's first (the stalled one's rejoin aside) applies deltas, every pull is
bit-exact, and the subscriber that holds every version reads at most a tenth of the bytes of
full pulls. Real processes and store, over tcp and shared memory (``local``), each read through an
emulated 0.05 Gbit/s link, where deltas pay (``delta_actors.Link``)."""

from __future__ import annotations

import os
import signal

import pytest

from wbridge import Delta, Staging

from .delta_layouts_actors import MixedPub, MixedSub
from .harness import Worker, call_all, free_port

LINK_GBPS = 0.05  # full pulls of ~0.5 s: deltas win by far, also under CI load (0.25 lost to it once)
LAST = 10  # versions published


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "local"])
def test_deltas_survive_new_layouts_repacks_late_joiners_and_a_rejoin(transport: str) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    kw = dict(staging=Staging(delta=Delta()), transport=transport, mode="one_step_off")
    pubs = [Worker(f"pub{r}", MixedPub, url, r, host_store=(r == 0), **kw) for r in range(2)]
    whole = Worker("whole", MixedSub, url, "whole", LINK_GBPS, transport=transport)
    rows = Worker("rows", MixedSub, url, "rows", LINK_GBPS, transport=transport, lease_ttl=2.0)
    subs = {"whole": whole, "rows": rows}
    got: dict[str, list[dict]] = {"whole": [], "rows": [], "cols0": [], "cols1": []}
    rejoin: dict | None = None
    try:
        for v in range(1, LAST + 1):
            if v == 4:  # the row slice stalls past its lease: versions 4 to 6 go on without it
                os.kill(rows.proc.pid, signal.SIGSTOP)
            assert [r for r in call_all(pubs, "publish", v)] == [v, v]
            if v == 6:  # it resumes: joins again (a new id) and pulls version 6
                os.kill(rows.proc.pid, signal.SIGCONT)
                for k in ("cols0", "cols1"):  # column halves join: packed for from version 7 on
                    subs[k] = Worker(k, MixedSub, url, k, LINK_GBPS, transport=transport)
            for k, w in subs.items():
                if 4 <= v <= 5 and k == "rows":
                    continue
                r = w.call("pull", v)
                assert r["v"] == v and r["bad"] == [], (k, r)
                if k == "rows" and v == 6:
                    rejoin = r
                else:
                    got[k].append(r)
        for k, pulls in got.items():
            print(k, [(p["why"], p["nbytes"]) for p in pulls])
            assert not pulls[0]["delta"], (k, pulls[0])
            assert all(p["delta"] and p["repaired"] == 0 for p in pulls[1:]), (k, [p["why"] for p in pulls])
        print("rows rejoin", rejoin["why"], rejoin["nbytes"])
        # it holds version 3, and the deltas of 4 and 5 are in the packing of their own time
        assert rejoin["why"] == "new-layout", rejoin
        a = got["whole"]
        ratio = sum(p["nbytes"] for p in a[1:]) / sum(p["full"] for p in a[1:])
        print(f"whole: read {ratio:.4f} of the full bytes over its {len(a) - 1} pulls after the first")
        assert ratio <= 0.10, ratio
    finally:
        for w in [*subs.values(), *pubs]:
            w.stop()
