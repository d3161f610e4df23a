"""Reader-ordered slots in the runtime: publishers pack their staging slots for the layouts of the
live subscribers (announced once per distinct layout), a subscriber that joins later reads the
current slots correctly and is packed for from the next version on, and staging=ZeroCopy() reads the
live tensors as before. Real processes, real store, tcp."""

from __future__ import annotations

import pytest

from wbridge import Staging, ZeroCopy

from .actors import PubActor, SubActor
from .harness import Worker, call_all, free_port

pytestmark = pytest.mark.timeout(240)


def _run(zero_copy: bool) -> dict:
    url = f"tcp://127.0.0.1:{free_port()}"
    workers: list[Worker] = []
    try:
        kw = {
            "transport": ["tcp"],
            "staging": ZeroCopy() if zero_copy else Staging(),
            "mode": "sync" if zero_copy else "one_step_off",
        }
        pubs = [Worker("pub0", PubActor, url, 0, 2, 2, host_store=True, **kw)]
        pubs.append(Worker("pub1", PubActor, url, 1, 2, 2, **kw))
        workers += pubs
        a = Worker("sub-a", SubActor, url, 4, 0, transport="tcp")
        workers.append(a)
        out: dict = {}
        if zero_copy:  # zero-copy versions are readable only while publish() runs
            for s in pubs:
                s.send("publish", 1)
            got = a.call("pull", min_version=1)
            call_all_results(pubs)
            out["a1"] = got
            return out
        assert [r["v"] for r in call_all(pubs, "publish", 1)] == [1, 1]
        out["a1"] = a.call("pull", min_version=1)
        b = Worker("sub-b", SubActor, url, 4, 2, transport="tcp")  # joins after version 1
        workers.append(b)
        out["b1"] = b.call("pull", min_version=1)
        assert [r["v"] for r in call_all(pubs, "publish", 2)] == [2, 2]
        out["a2"] = a.call("pull", min_version=2)
        out["b2"] = b.call("pull", min_version=2)
        assert [r["v"] for r in call_all(pubs, "publish", 3)] == [3, 3]
        out["b3"] = b.call("pull", min_version=3)
        return out
    finally:
        for w in reversed(workers):
            w.stop()


def call_all_results(workers: list[Worker]) -> None:
    for w in workers:
        w.result()


def test_slots_packed_for_readers_and_late_joiner():
    got = _run(zero_copy=False)
    for k, r in got.items():
        assert r["bad"] == [], f"{k} not bit-exact at v{r['v']}: {r['bad'][:3]}"
    assert [got[k]["v"] for k in ("a1", "b1", "a2", "b2", "b3")] == [1, 1, 2, 2, 3]
    # B read version 1 from slots packed for A only: its column slices were strided there.
    # From version 2 on the slots hold them contiguous: far fewer reads, same bytes.
    assert got["b2"]["ops"] * 4 <= got["b1"]["ops"], (got["b1"]["ops"], got["b2"]["ops"])
    assert got["b3"]["ops"] == got["b2"]["ops"]


def test_zero_copy_reads_live_tensors_as_before():
    got = _run(zero_copy=True)
    assert got["a1"]["v"] == 1 and got["a1"]["bad"] == []


def test_torch_copy_program_matches_numpy():
    """The strided torch copy (the GPU path) against the numpy one, on CPU tensors that are
    views at an offset of a larger storage."""
    import numpy as np
    import torch

    from planner import LayoutBuilder, Shard
    from planner.packing import pack_staging
    from wbridge._tensors import byte_view
    from wbridge.publish.packing import copy_packed, copy_torch

    src = LayoutBuilder(0)
    src.add("w", (16, 12), "bfloat16", Shard("w", (16, 24), (0, 0)))
    src.add("o", (8, 24), "bfloat16", Shard("o", (8, 24)))
    reader = LayoutBuilder(1)
    reader.add("w", (16, 6), "bfloat16", Shard("w", (16, 24), (0, 6)))
    reader.add("o", (4, 24), "bfloat16", Shard("o", (8, 24), (4, 0)))
    ps = pack_staging(src.build(), [reader.build()])
    assert not ps.identity
    store = torch.arange(1000, dtype=torch.int16).to(torch.bfloat16)
    live = [store[10:202].view(16, 12), store[300:492].view(8, 24)]
    size = ps.layout.region_sizes[0]
    want = torch.zeros(size, dtype=torch.uint8)
    copy_packed(ps, live, want)
    got = torch.zeros(size + 7, dtype=torch.uint8)[7:]
    copy_torch(ps, [byte_view(t) for t in live], got)
    assert np.array_equal(got.numpy(), want.numpy()) and want.any()


def test_snapshot_keeps_the_packed_copy_program_per_slot():
    """The publisher's snapshot into a packed slot (column strips by torch, whole runs by numpy,
    live tensors at unaligned offsets of a larger storage) equals the copy program run by numpy;
    its views are made once per slot and packing, follow the live values, and are made again
    when the packing changes."""
    import numpy as np
    import torch

    from planner import LayoutBuilder, Shard
    from planner.packing import copy_boxes, pack_staging
    from wbridge._tensors import build_layout, byte_view
    from wbridge.publish.staging import build_registration, snapshot

    store = torch.arange(40_000, dtype=torch.int16).to(torch.bfloat16)
    live = {
        "w": (store[3:3 + 64 * 48].view(64, 48), Shard("w", (64, 96), (0, 0))),
        "o": (store[7000:7000 + 32 * 96].view(32, 96), Shard("o", (32, 96))),
    }  # fmt: skip
    layout, tensors, _ = build_layout(0, live, pack=True, who="trainer")

    def reader(cols: int, rank: int):
        b = LayoutBuilder(rank)
        b.add("w", (64, cols), "bfloat16", Shard("w", (64, 96), (0, 8)))
        b.add("o", (16, 96), "bfloat16", Shard("o", (32, 96), (16, 0)))
        return b.build()

    packs = [pack_staging(layout, [reader(24, 1)]), pack_staging(layout, [reader(12, 2)])]
    assert not any(ps.identity for ps in packs)
    reg = build_registration({}, layout, tensors, {}, "cpu", None, {}, 2, False, "cpu")

    def want(ps):
        out = np.zeros(int(reg.slots[1][0].numel()), dtype=np.uint8)
        copy_boxes(ps.copies, [byte_view(t).numpy() for t in tensors.values()], [out])
        return out

    snapshot(reg, 1, None, packs[0])
    first = reg.packed_copies[1]
    assert np.array_equal(reg.slots[1][0].numpy(), want(packs[0])) and want(packs[0]).any()
    store.mul_(3)  # the trainer's next values
    snapshot(reg, 1, None, packs[0])
    assert reg.packed_copies[1] is first
    assert np.array_equal(reg.slots[1][0].numpy(), want(packs[0]))
    snapshot(reg, 1, None, packs[1])
    assert reg.packed_copies[1] is not first and reg.packed_copies[1].ps is packs[1]
    assert np.array_equal(reg.slots[1][0].numpy(), want(packs[1]))
