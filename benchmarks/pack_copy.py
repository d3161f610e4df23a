"""The snapshot copy into a reader-ordered slot against the plain snapshot copy, side by side.

A publisher rank of a synthetic Qwen-like model (``--model``: trainer TP=2, rank 0, separate
q/k/v and gate/up) copies its live tensors into its staging slot two ways, alternating, in one
process: the plain copy (one contiguous copy per tensor, what ``Publisher`` does without readers)
and the copy program of a slot packed for the rollout layouts (TP=``--rollout-tp``, fused; one
strided copy per cell, ``wbridge._packing.copy_packed``). Both slots are checked to hold the same
mapped bytes. Prints ``pack_copy: packed_vs_plain=<median packed / median plain>`` last.
Run: ``PYTHONPATH=. .venv/bin/python benchmarks/pack_copy.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from planner.packing import pack_staging
from wbridge._packing import copy_packed
from wbridge._tensors import build_layout, byte_view
from wbridge.testing.synthetic import ModelConfig, make_tensors

MODELS = {
    "small": ModelConfig(hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816, layers=8, vocab=32000),
    "medium": ModelConfig(hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=5632, layers=8, vocab=32000),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--rollout-tp", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--quiet", action="store_true", help="print only the summary line")
    args = ap.parse_args()
    cfg = MODELS[args.model]
    layout, live, _ = build_layout(0, make_tensors(cfg, 2, 0, fused=False, version=1), pack=True, who="trainer")
    readers = [
        build_layout(i, make_tensors(cfg, args.rollout_tp, i, fused=True, version=None), pack=False, who="rollout")[0]
        for i in range(args.rollout_tp)
    ]
    ps = pack_staging(layout, readers)
    plain = torch.zeros(layout.region_sizes[0], dtype=torch.uint8)
    packed = torch.zeros(ps.layout.region_sizes[0], dtype=torch.uint8)
    pairs = [
        (plain[t.offset : t.offset + t.nbytes].numpy(), byte_view(x).numpy())
        for x, t in zip(live.values(), layout.tensors)
    ]
    tensors = list(live.values())
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    for _ in range(args.repeat):  # alternating, so load from other work hits both alike
        t0 = time.perf_counter()
        for dst, src in pairs:
            np.copyto(dst, src)
        t1 = time.perf_counter()
        copy_packed(ps, tensors, packed)
        t2 = time.perf_counter()
        times["plain"].append(t1 - t0)
        times["packed"].append(t2 - t1)
    # same mapped bytes: every packed cell equals the canonical box the plain slot holds there
    ok = _same_bytes(layout, plain.numpy(), ps.layout, packed.numpy())
    if not ok:
        raise SystemExit("pack_copy: the packed slot differs from the plain one")
    p, q = statistics.median(times["plain"]), statistics.median(times["packed"])
    if not args.quiet:
        print(
            f"model={args.model} bytes={layout.nbytes} tensors={len(layout.tensors)} cells={len(ps.copies)} "
            f"plain_ms={p * 1e3:.2f} packed_ms={q * 1e3:.2f} slot_over_plain={packed.numel() / plain.numel():.4f}"
        )
    print(f"pack_copy: packed_vs_plain={q / p:.2f}")


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
