"""Reference checks for layouts: pieces applied with numpy, independent of the planner.

``check_entries`` proves a declaration describes a live tensor: every piece's elements equal the
canonical tensor's box, bit for bit. ``assemble`` rebuilds canonical tensors from the entries of
all source ranks (and proves every element is covered); ``scatter`` writes canonical tensors into
destination entries that were garbage-filled first, and ``check_written`` proves every mapped
destination element was written.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from planner.compiler import pieces_for
from planner.layout import Piece
from transports._util import free_port  # noqa: F401 (re-exported for callers)

GARBAGE = 0x5A


def to_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()


def piece_view(flat: np.ndarray, p: Piece) -> np.ndarray:
    """The elements of local flat array ``flat`` that piece ``p`` covers, shaped as its box."""
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(
        flat[p.offset :], shape=p.box.sizes, strides=tuple(s * item for s in p.strides), writeable=True
    )


def canonical_view(full: np.ndarray, p: Piece) -> np.ndarray:
    return full[tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))]


def pieces_of(name: str, local: Any, decl) -> tuple[Piece, ...]:
    return pieces_for(name, decl, tuple(local.shape))


def check_entries(entries: Mapping[str, tuple[Any, Any]], full: Mapping[str, Any]) -> int:
    """Asserts every piece of every entry equals the canonical data; returns elements checked."""
    n = 0
    for name, (local, decl) in entries.items():
        flat = to_numpy(local).reshape(-1)
        for p in pieces_of(name, local, decl):
            want = canonical_view(to_numpy(full[p.tensor]), p)
            got = piece_view(flat, p)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
                f"{name}: piece of {p.tensor} at {p.box} differs"
            )
            n += p.box.numel
    return n


def assemble(
    per_rank: Iterable[Mapping[str, tuple[Any, Any]]], shapes: Mapping[str, tuple], dtype
) -> dict[str, np.ndarray]:
    """Canonical tensors rebuilt from source entries; asserts full coverage and agreeing replicas."""
    out = {k: np.zeros(s, dtype=dtype) for k, s in shapes.items()}
    seen = {k: np.zeros(s, dtype=np.int32) for k, s in shapes.items()}
    for entries in per_rank:
        for name, (local, decl) in entries.items():
            flat = to_numpy(local).reshape(-1)
            for p in pieces_of(name, local, decl):
                cv = canonical_view(out[p.tensor], p)
                sv = canonical_view(seen[p.tensor], p)
                src = piece_view(flat, p)
                dup = sv > 0
                assert np.array_equal(cv[dup], src[dup]), f"{name}: replicas of {p.tensor} disagree"
                cv[...] = src
                sv += 1
    for k, s in seen.items():
        missing = int((s == 0).sum())
        assert missing == 0, f"{k}: {missing} elements held by no source rank"
    return out


def scatter(entries: Mapping[str, tuple[Any, Any]], full: Mapping[str, np.ndarray]) -> None:
    """Writes canonical data into destination entries through their pieces (a reference pull)."""
    for name, (local, decl) in entries.items():
        flat = to_numpy(local).reshape(-1)
        for p in pieces_of(name, local, decl):
            piece_view(flat, p)[...] = canonical_view(full[p.tensor], p)


def garbage_fill(entries: Mapping[str, tuple[Any, Any]]) -> None:
    for local, _ in entries.values():
        to_numpy(local).view(np.uint8).reshape(-1)[:] = GARBAGE


def mapped_mask(name: str, local: Any, decl) -> np.ndarray:
    mask = np.zeros(math.prod(local.shape), dtype=bool)
    for p in pieces_of(name, local, decl):
        piece_view(mask, p)[...] = True
    return mask


def run_ranks(
    script: str, world: int, extra: list[str], timeout: float, python: str | None = None, env: dict | None = None
) -> None:
    """Runs ``world`` processes of ``script RANK WORLD PORT *extra``; kills all on timeout or failure."""
    import os
    import subprocess
    import sys
    import time

    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    penv = dict(os.environ, PYTHONPATH=root, **(env or {}))
    procs = [
        subprocess.Popen(
            [python or sys.executable, script, str(r), str(world), str(port), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=penv,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            out, _ = p.communicate(timeout=left)
            outs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)
        raise AssertionError(f"{script}: ranks did not finish within {timeout}s") from None
    bad = [(r, p.returncode, outs[r][-3000:]) for r, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"{script}: ranks failed: {bad}"


def plan_transfer(sources: list[Mapping[str, tuple[Any, Any]]], dests: list[Mapping[str, tuple[Any, Any]]]) -> None:
    """Moves bytes from source entries to destination entries with the planner's plans, executed
    by the planner tests' numpy executor: sources packed as a publisher's staging slot, each
    destination tensor its own region (the live tensors, garbage-filled first). Asserts every
    mapped destination byte was written exactly once and no unmapped byte was touched."""
    import torch

    from planner.builder import build_plans
    from planner.compiler import LayoutBuilder
    from planner.dtypes import normalize
    from tests.planner.helpers import execute

    def dtype_of(t):
        return normalize(t.dtype) if isinstance(t, torch.Tensor) else str(t.dtype)

    src_layouts, src_regions = [], {}
    for r, entries in enumerate(sources):
        b = LayoutBuilder(r, pack=True)
        for name, (t, decl) in entries.items():
            b.add(name, tuple(t.shape), dtype_of(t), decl)
        lay = b.build()
        buf = np.zeros(lay.region_sizes[0] if lay.region_sizes else 0, dtype=np.uint8)
        for lt, (t, _) in zip(lay.tensors, entries.values()):
            buf[lt.offset : lt.offset + lt.nbytes] = to_numpy(t).reshape(-1).view(np.uint8)
        src_layouts.append(lay)
        src_regions[r] = [buf]
    dst_layouts, dst_regions = [], []
    for r, entries in enumerate(dests):
        b = LayoutBuilder(1000 + r, pack=False)
        for name, (t, decl) in entries.items():
            b.add(name, tuple(t.shape), dtype_of(t), decl)
        dst_layouts.append(b.build())
        garbage_fill(entries)
        dst_regions.append([to_numpy(t).reshape(-1).view(np.uint8) for t, _ in entries.values()])
    plans = build_plans(src_layouts, dst_layouts, min_split_bytes=1 << 12)
    for lay, regions, entries in zip(dst_layouts, dst_regions, dests):
        counts = [np.zeros(len(x), dtype=np.int32) for x in regions]
        execute(plans[lay.rank], src_regions, regions, counts)
        for (name, (t, decl)), cnt in zip(entries.items(), counts):
            m = mapped_mask(name, t, decl)
            per_byte = np.repeat(m, to_numpy(t).itemsize)
            assert (cnt[per_byte] == 1).all(), f"{name}: mapped bytes not written exactly once"
            assert not cnt[~per_byte].any(), f"{name}: unmapped bytes written"
