"""Compress a parameter's traced element map into planner declarations (Shard, Fused, Stack, Flat)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.compiler import pieces_for
from planner.layout import Declaration, Flat, Fused, Shard, Stack, row_major_strides

from ...errors import LayoutError
from .result import View, _shards
from .tags import CHUNK, _ids, _select


@dataclass
class _Map:
    """Per-element origin of one (view of a) parameter: tensor index (-1 unmapped) and canonical
    multi-index (rows of ``coords``; zero past the tensor's rank)."""

    shape: tuple[int, ...]
    tid: np.ndarray  # (N,)
    coords: np.ndarray  # (max_ndim, N)

    def sub(self, i: int) -> _Map:
        inner = math.prod(self.shape[1:])
        sl = slice(i * inner, (i + 1) * inner)
        return _Map(self.shape[1:], self.tid[sl], self.coords[:, sl])


def _box_of(m: _Map, t: int, gshape: tuple[int, ...], sel: np.ndarray | None = None):
    """If the elements ``sel`` (default all) of ``m`` are tensor ``t``'s box in row-major order:
    ``(offsets, sizes)``; else None."""
    nd = len(gshape)
    c = m.coords[:nd] if sel is None else m.coords[:nd, sel]
    if c.shape[1] == 0:
        return None
    lo = c[:, 0]
    hi = c[:, -1]
    sizes = hi - lo + 1
    if np.any(sizes <= 0) or int(np.prod(sizes)) != c.shape[1]:
        return None
    dims = tuple(int(s) for s in sizes)
    for d in range(nd):  # row-major box: coordinate d is lo[d] + its index along d
        ramp = (lo[d] + np.arange(dims[d], dtype=c.dtype)).reshape([-1 if k == d else 1 for k in range(nd)])
        if not (c[d].reshape(dims) == ramp).all():
            return None
    return tuple(int(x) for x in lo), dims


def _as_shard(m: _Map, names: Sequence[str], shapes: Sequence[tuple]) -> Declaration | None:
    if not (m.tid >= 0).all() or m.tid.size == 0:
        return None
    t = int(m.tid[0])
    if not (m.tid == t).all():
        return None
    box = _box_of(m, t, shapes[t])
    if box is None:
        return None
    lo, sizes = box
    return Shard(names[t], shapes[t], lo, None if sizes == tuple(m.shape) else sizes)


def _local_index(shape: tuple[int, ...]) -> np.ndarray:
    return np.stack(np.unravel_index(np.arange(math.prod(shape)), shape)) if shape else np.zeros((0, 1), np.int64)


def _as_padded(m: _Map, names: Sequence[str], shapes: Sequence[tuple]) -> Declaration | None:
    mapped = m.tid >= 0
    if not mapped.any() or mapped.all():
        return None
    tids = [t for t in _ids(m.tid) if t >= 0]
    if len(tids) != 1:
        return None
    t = int(tids[0])
    g = shapes[t]
    if len(g) != len(m.shape):
        return None
    local = _local_index(m.shape)
    first = int(np.argmax(mapped))
    o = m.coords[: len(g), first] - local[:, first]
    c = local + o[:, None]
    inside = np.all((c >= 0) & (c < np.array(g)[:, None]), axis=0)
    if not np.array_equal(inside, mapped) or not np.array_equal(c[:, mapped], m.coords[: len(g), mapped]):
        return None
    if np.any(o < 0):
        return None
    return Shard(names[t], g, tuple(int(x) for x in o), padded=True)


def _as_fused(m: _Map, d: int, names: Sequence[str], shapes: Sequence[tuple]) -> Declaration | None:
    if not (m.tid >= 0).all():
        return None
    nd = len(m.shape)
    n = m.shape[d]
    if n < 2:
        return None
    slab = tuple(1 if i == d else s for i, s in enumerate(m.shape))
    idx = np.moveaxis(np.arange(m.tid.size).reshape(m.shape), d, 0).reshape(n, -1)
    tid = m.tid[idx]  # (n, slab numel)
    if not (tid == tid[:, :1]).all():
        return None
    rel = _local_index(slab)  # (nd, slab numel); dim d is 0
    parts: list[Shard] = []
    run_t, run_o, run_len = -1, None, 0
    for i in range(n):
        t = int(tid[i, 0])
        g = shapes[t]
        if len(g) != nd:
            return None
        c = m.coords[:nd][:, idx[i]]
        o = c[:, 0]
        if not np.array_equal(c, rel + o[:, None]):
            return None
        if t == run_t and run_o is not None and np.array_equal(o, run_o + np.eye(nd, dtype=np.int64)[d] * run_len):
            run_len += 1
            continue
        if run_t >= 0:
            parts.append(_part(names, shapes, run_t, run_o, run_len, d, m.shape))
        run_t, run_o, run_len = t, o, 1
    parts.append(_part(names, shapes, run_t, run_o, run_len, d, m.shape))
    if len(parts) < 2:
        return None
    return Fused(d, tuple(parts))


def _part(names, shapes, t, o, length, d, shape) -> Shard:
    sizes = tuple(length if i == d else s for i, s in enumerate(shape))
    return Shard(names[t], shapes[t], tuple(int(x) for x in o), sizes)


def _as_stack(m: _Map, names: Sequence[str], shapes: Sequence[tuple]) -> Declaration | None:
    if len(m.shape) < 2 or not (m.tid >= 0).all():
        return None
    parts = []
    for i in range(m.shape[0]):
        s = _as_shard(m.sub(i), names, shapes)
        if s is None:
            return None
        sizes = s.sizes if s.sizes is not None else tuple(m.shape[1:])
        parts.append(Shard(s.name, s.global_shape, s.offsets, None if sizes == tuple(m.shape[1:]) else sizes))
    return Stack(tuple(parts))


def _as_flat(m: _Map, names: Sequence[str], shapes: Sequence[tuple]) -> Declaration | None:
    if len(m.shape) != 1:
        return None
    mapped = m.tid >= 0
    k = int(mapped.sum())
    if k == 0 or not mapped[:k].all():
        return None
    segs = []
    flat = np.empty(k, dtype=np.int64)
    for t in [t for t in _ids(m.tid[:k]) if t >= 0]:
        sel = m.tid[:k] == t
        flat[sel] = np.ravel_multi_index(tuple(m.coords[: len(shapes[t]), :k][:, sel]), shapes[int(t)])
    start = 0
    for i in range(1, k + 1):
        if i == k or m.tid[i] != m.tid[i - 1] or flat[i] != flat[i - 1] + 1:
            t = int(m.tid[start])
            segs.append((names[t], shapes[t], int(flat[start]), int(flat[i - 1]) + 1))
            start = i
    return Flat(tuple(segs))


def _declare(param: str, m: _Map, names, shapes, depth: int = 0, view: View = ()) -> list[tuple[View, Declaration]]:
    decl = _as_shard(m, names, shapes) or _as_padded(m, names, shapes)
    if decl is None:
        for d in range(len(m.shape)):
            decl = _as_fused(m, d, names, shapes)
            if decl is not None:
                break
    if decl is None:
        decl = _as_stack(m, names, shapes) or _as_flat(m, names, shapes)
    if decl is not None:
        return [(view, decl)]
    if len(m.shape) >= 2 and depth < 2:
        out = []
        for i in range(m.shape[0]):
            sub = m.sub(i)
            if (sub.tid < 0).all():
                continue
            out += _declare(param, sub, names, shapes, depth + 1, view + (i,))
        return out
    where = f"{param}[{', '.join(map(str, view))}]" if view else param
    raise LayoutError(
        f"{where}: the loader's placement of {sorted(names[t] for t in _ids(m.tid) if t >= 0)} "
        f"is not expressible as shards/fused/stacked slices (shape {m.shape})"
    )


def _pieces_ordered(param: str, shape: tuple[int, ...], items: Sequence[tuple[View, Declaration]]) -> bool:
    """Fast sufficient check that canonical elements land in increasing order: each piece is a
    row-major box (ordered inside); pieces of one tensor, taken in local order, must cover
    increasing, non-interleaved canonical flat ranges."""

    strides = row_major_strides(shape)
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for view, decl in items:
        base = sum(i * st for i, st in zip(view, strides))
        for p in pieces_for(param, decl, shape[len(view) :]):
            if not p.box.numel:
                continue
            g = row_major_strides(_shards_shape(decl, p.tensor))
            start = sum(o * st for o, st in zip(p.box.offsets, g))
            end = sum((o + s - 1) * st for o, s, st in zip(p.box.offsets, p.box.sizes, g))
            spans.setdefault(p.tensor, []).append((base + p.offset, start, end))
    for lst in spans.values():
        lst.sort()
        if any(b[1] <= a[2] for a, b in zip(lst, lst[1:])):
            return False
    return True


def _shards_shape(decl: Declaration, name: str) -> tuple[int, ...]:
    for s in _shards(decl):
        if s.name == name:
            return s.global_shape
    raise LayoutError(f"{name}: not in declaration {decl!r}")


def _check_order(param: str, m: _Map, names, shapes) -> None:
    """Each canonical tensor's elements must appear in increasing order (a slicing copy)."""
    ids = _ids(m.tid)
    for t in ids:
        if t < 0:
            continue
        sel = _select(m.tid, t, ids)
        c = m.coords[: len(shapes[t])]
        c = c if isinstance(sel, slice) else c[:, sel]
        last, bad = -1, False
        for a in range(0, c.shape[1], CHUNK):
            flat = np.ravel_multi_index(tuple(c[:, a : a + CHUNK]), shapes[t])
            if flat[0] <= last or np.any(np.diff(flat) <= 0):
                bad = True
                break
            last = int(flat[-1])
        if bad:
            flat = np.ravel_multi_index(tuple(c), shapes[t])
            dup = len(np.unique(flat)) != len(flat)
            raise LayoutError(
                f"{param}: the loader "
                + (f"copies elements of {names[t]} more than once" if dup else f"reorders {names[t]}")
                + " inside the parameter (not a slicing: a transpose, a permutation or a wrong fusion order "
                "within one tensor)"
            )


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------
