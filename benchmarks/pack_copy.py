"""The snapshot copy into a reader-ordered slot against the plain snapshot copy, side by side.

A publisher rank of a synthetic Qwen-like model (``--model``: trainer TP=2, rank 0, separate
q/k/v and gate/up) fills its staging slots two ways, alternating, in one process, with the
publisher's own snapshot function (``wbridge.publish.staging.snapshot``, on slots made as a ``Publisher``
makes them: ``--transport``'s host buffers where it has them): the plain copy (one contiguous copy
per tensor, what ``Publisher`` does without readers) and the copy program of a slot packed for
rollout layouts that split the trainer's tensors differently (TP=``--rollout-tp``, fused: the
row-parallel ``o_proj``/``down_proj`` are cut into column strips; ``wbridge.publish.packing.copy_packed``).
Both slots are checked to hold the same mapped bytes. Prints
``pack_copy: packed_vs_plain=<r>`` last: the median over repetitions of packed time over the plain
time next to it. ``benchmarks/stall.py`` prints the same measurement (``measure``) for its model.
Run: ``PYTHONPATH=. .venv/bin/python benchmarks/pack_copy.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from planner.packing import copy_boxes, pack_staging
from wbridge._tensors import build_layout, byte_view
from wbridge.publish.staging import build_registration, snapshot
from wbridge.testing.synthetic import ModelConfig, make_tensors

MODELS = {
    "small": ModelConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816, layers=8, vocab=32000),
    "medium": ModelConfig(hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632, layers=8, vocab=32000),
}


def measure(
    cfg: ModelConfig,
    tp: int,
    rank: int,
    rollout_tp: int,
    repeat: int,
    transport: str | None = None,
    full_check: bool = True,
) -> dict:
    """Trainer rank ``rank`` of TP=``tp`` snapshots into a plain slot and into a slot packed for
    the ``rollout_tp`` fused rollout layouts, alternating ``repeat`` times; returns the per-copy
    seconds (``plain``, ``packed``), ``packed_vs_plain`` (median of the paired ratios), ``bytes``,
    ``cells`` and ``slot_over_plain``. The packed slot is checked against the copy program run by
    numpy (``planner.packing.copy_boxes``) and, with ``full_check``, every mapped element against
    the plain slot (slow on large models). Raises ``RuntimeError`` if the bytes differ."""
    import transports as _transports

    layout, live, _ = build_layout(rank, make_tensors(cfg, tp, rank, fused=False, version=1), pack=True, who="trainer")
    readers = [
        build_layout(i, make_tensors(cfg, rollout_tp, i, fused=True, version=None), pack=False, who="rollout")[0]
        for i in range(rollout_tp)
    ]
    ps = pack_staging(layout, readers)
    packed_size = ps.layout.region_sizes[0]
    served = {transport: _transports.get(transport)(token=b"pack-copy")} if transport else {}
    try:
        # two slots of the packed size (never smaller than the plain one), as a publisher's
        plain_lay = layout if packed_size <= layout.region_sizes[0] else _grown(layout, packed_size)
        reg = build_registration(served, plain_lay, live, {}, "cpu", None, {}, 2, False, "cpu")
        times: dict[str, list[float]] = {"plain": [], "packed": []}
        for _ in range(repeat):  # alternating, so load from other work hits both alike
            t0 = time.perf_counter()
            snapshot(reg, 0, None, None)
            t1 = time.perf_counter()
            snapshot(reg, 1, None, ps)
            t2 = time.perf_counter()
            times["plain"].append(t1 - t0)
            times["packed"].append(t2 - t1)
        packed = reg.slots[1][0].numpy()
        want = np.zeros_like(packed)
        copy_boxes(ps.copies, [byte_view(t).numpy() for t in live.values()], [want])
        if not np.array_equal(packed, want):
            raise RuntimeError("pack_copy: the packed slot differs from the copy program run by numpy")
        # same mapped bytes: every packed cell equals the canonical box the plain slot holds there
        if full_check and not _same_bytes(layout, reg.slots[0][0].numpy(), ps.layout, packed):
            raise RuntimeError("pack_copy: the packed slot differs from the plain one")
    finally:
        for t in served.values():
            t.close()
    return {
        **times,
        "packed_vs_plain": statistics.median(q / p for p, q in zip(times["plain"], times["packed"])),
        "bytes": layout.nbytes,
        "tensors": len(layout.tensors),
        "cells": len(ps.copies),
        "slot_over_plain": packed_size / layout.region_sizes[0],
    }


def _grown(layout: Any, size: int) -> Any:
    from planner.layout import RankLayout

    return RankLayout(layout.rank, layout.tensors, layout.specs, (size,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--rollout-tp", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--transport", default="local", help="whose host buffers the slots are ('': plain memory)")
    ap.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = ap.parse_args()
    r = measure(MODELS[args.model], 2, 0, args.rollout_tp, args.repeat, args.transport or None)
    p, q = statistics.median(r["plain"]), statistics.median(r["packed"])
    if not args.quiet:
        print(
            f"model={args.model} bytes={r['bytes']} tensors={r['tensors']} cells={r['cells']} "
            f"plain_ms={p * 1e3:.2f} packed_ms={q * 1e3:.2f} slot_over_plain={r['slot_over_plain']:.4f}"
        )
    print(f"pack_copy: packed_vs_plain={r['packed_vs_plain']:.2f}")


def _same_bytes(a_layout, a: np.ndarray, b_layout, b: np.ndarray) -> bool:
    """Whether both slots hold the same bytes for every canonical element either maps."""

    def canon(layout, buf) -> dict[str, np.ndarray]:
        out = {}
        specs = layout.spec_map()
        for t in layout.tensors:
            for p in t.pieces:
                sp = specs[p.tensor]
                isz = t.itemsize
                full = out.setdefault(p.tensor, np.zeros(sp.numel * isz, dtype=np.uint8))
                loc = np.array([p.offset], dtype=np.int64)
                can = np.zeros(1, dtype=np.int64)
                cstr = [int(np.prod(sp.shape[i + 1 :])) for i in range(len(sp.shape))]
                for o, n, st, cs in zip(p.box.offsets, p.box.sizes, p.strides, cstr):
                    idx = np.arange(n, dtype=np.int64)
                    loc = (loc[:, None] + idx * st).ravel()
                    can = (can[:, None] + (idx + o) * cs).ravel()
                byte = np.arange(isz, dtype=np.int64)
                full[(can[:, None] * isz + byte).ravel()] = buf[(t.offset + loc[:, None] * isz + byte).ravel()]
        return out

    x, y = canon(a_layout, a), canon(b_layout, b)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


if __name__ == "__main__":
    main()
