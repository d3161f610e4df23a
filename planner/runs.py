"""Byte runs: the contiguous byte ranges that copy a box between two strided layouts.

A box of a canonical tensor sits in a source local tensor and in a destination local tensor, each
through element strides (see ``planner.layout``). ``box_runs`` turns it into runs of equal length,
row-major over the box: the innermost dimensions that are contiguous on *both* sides collapse
into one run, so an intersection of whole rows is one run, not one run per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


@lru_cache(maxsize=1 << 16)
def box_geometry(
    sizes: tuple[int, ...], src_strides: tuple[int, ...], dst_strides: tuple[int, ...], itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """``(shape, src_byte_strides, dst_byte_strides, run_bytes)``: the box as ``prod(shape)`` runs
    of ``run_bytes``, one per index of ``shape`` (row-major), each at ``index . strides`` bytes from
    the box's first element on either side.

    Dimensions of size 1 drop out, the innermost dimensions contiguous on both sides collapse into
    the run, and neighbouring outer dimensions that nest exactly on both sides merge, so a box is
    described with as few dimensions as its two layouts allow. A box with no elements has
    ``run_bytes == 0``.
    """
    dims = [(n, s, d) for n, s, d in zip(sizes, src_strides, dst_strides) if n != 1]
    if any(n == 0 for n, _, _ in dims):
        return (), (), (), 0
    block = 1
    k = len(dims)
    if dims and dims[-1][1] == 1 and dims[-1][2] == 1:
        block = dims[-1][0]
        k -= 1
        while k > 0 and dims[k - 1][1] == block and dims[k - 1][2] == block:
            block *= dims[k - 1][0]
            k -= 1
    outer: list[list[int]] = []
    for n, s, d in dims[:k]:
        if outer and outer[-1][1] == n * s and outer[-1][2] == n * d:
            outer[-1] = [outer[-1][0] * n, s, d]
        else:
            outer.append([n, s, d])
    return (
        tuple(n for n, _, _ in outer),
        tuple(s * itemsize for _, s, _ in outer),
        tuple(d * itemsize for _, _, d in outer),
        block * itemsize,
    )


@lru_cache(maxsize=1 << 16)
def box_runs(
    sizes: tuple[int, ...], src_strides: tuple[int, ...], dst_strides: tuple[int, ...], itemsize: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """``(src_offsets, dst_offsets, run_bytes)``: byte offsets of each run relative to the box's
    first element on each side, in row-major order of the box, and the common run length
    (``box_geometry`` expanded).

    Results are cached (every layer of a model repeats the same few geometries) and read-only.
    """
    shape, ss, ds, run = box_geometry(sizes, src_strides, dst_strides, itemsize)
    if run == 0:
        return _EMPTY, _EMPTY, 0
    src = np.zeros(1, dtype=np.int64)
    dst = np.zeros(1, dtype=np.int64)
    for n, s, d in zip(shape, ss, ds):
        idx = np.arange(n, dtype=np.int64)
        src = (src[:, None] + idx * s).ravel()
        dst = (dst[:, None] + idx * d).ravel()
    src.setflags(write=False)
    dst.setflags(write=False)
    return src, dst, run


KEY_SHIFT = 48  # sort keys: region << 48 | byte offset (regions up to 256 TiB)


def sort_order(keys: np.ndarray) -> np.ndarray | None:
    """A stable sorting permutation of ``keys``, or None when they are already sorted.

    Runs are emitted as ascending runs (a box's rows in order), so the keys are a concatenation
    of sorted runs: order the runs by their first key, and keep that if the result is sorted
    (runs that do not interleave, the usual case): O(n + r log r) instead of O(n log n).
    """
    n = len(keys)
    if n < 2:
        return None
    brk = np.flatnonzero(keys[1:] < keys[:-1]) + 1
    if not len(brk):
        return None
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.append(starts, n))
    by_first = np.argsort(keys[starts], kind="stable")
    lens_sorted = lens[by_first]
    perm = np.repeat(starts[by_first] - (np.cumsum(lens_sorted) - lens_sorted), lens_sorted)
    perm += np.arange(n, dtype=perm.dtype)
    k = keys[perm]
    if not (k[1:] < k[:-1]).any():
        return perm
    return np.argsort(keys, kind="stable")


def coalesce(
    src_region: np.ndarray, src_offset: np.ndarray, dst_region: np.ndarray, dst_offset: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Sorts runs by source address and merges neighbours contiguous on both sides.

    Returns the five columns, sorted by ``(src_region, src_offset)``.
    """
    if len(nbytes) == 0:
        return src_region, src_offset, dst_region, dst_offset, nbytes
    order = sort_order((src_region << KEY_SHIFT) + src_offset)
    if order is None:
        sr, so, dr, do, nb = src_region, src_offset, dst_region, dst_offset, nbytes
    else:
        sr, so, dr, do, nb = (a[order] for a in (src_region, src_offset, dst_region, dst_offset, nbytes))
    if len(nb) > 1:
        cont = np.empty(len(nb), dtype=bool)
        cont[0] = False
        cont[1:] = (
            (sr[1:] == sr[:-1]) & (so[1:] == so[:-1] + nb[:-1]) & (dr[1:] == dr[:-1]) & (do[1:] == do[:-1] + nb[:-1])
        )
        if cont.any():
            starts = np.flatnonzero(~cont)
            nb = np.add.reduceat(nb, starts)
            sr, so, dr, do = sr[starts], so[starts], dr[starts], do[starts]
    return sr, so, dr, do, nb


def merge_intervals(
    region: np.ndarray, offset: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted, merged ``(region, start, stop)`` of possibly touching (not overlapping) intervals."""
    if len(nbytes) == 0:
        return region, offset, offset
    order = sort_order((region << KEY_SHIFT) + offset)
    if order is None:
        r, a, b = region, offset, offset + nbytes
    else:
        r, a = region[order], offset[order]
        b = a + nbytes[order]
    if len(r) > 1:
        new = np.ones(len(r), dtype=bool)
        # Compare as (region, offset) keys: a running maximum of bare offsets would carry one
        # region's stops into the next and merge that region's separate intervals.
        new[1:] = (r[1:] != r[:-1]) | (a[1:] + (r[1:] << KEY_SHIFT) > np.maximum.accumulate(b + (r << KEY_SHIFT))[:-1])
        starts = np.flatnonzero(new)
        stops = np.maximum.reduceat(b, starts)
        r, a, b = r[starts], a[starts], stops
    return r, a, b


def piece_intervals(
    pieces: Sequence[tuple[int, int, tuple[int, ...], tuple[int, ...], int]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merged byte intervals covered by pieces given as ``(region, base_byte, sizes, strides, itemsize)``."""
    by_geom: dict[tuple, tuple[list[int], list[int]]] = {}
    for region, base, sizes, strides, isz in pieces:
        regs_bases = by_geom.get((sizes, strides, isz))
        if regs_bases is None:
            regs_bases = by_geom[(sizes, strides, isz)] = ([], [])
        regs_bases[0].append(region)
        regs_bases[1].append(base)
    regs, offs, lens = [_EMPTY], [_EMPTY], [_EMPTY]
    for (sizes, strides, isz), (rg, bs) in by_geom.items():
        rel, _, run = box_runs(tuple(sizes), tuple(strides), tuple(strides), isz)
        if run == 0:
            continue
        n = len(rel)
        regs.append(np.repeat(np.asarray(rg, dtype=np.int64), n))
        offs.append((np.asarray(bs, dtype=np.int64)[:, None] + rel[None, :]).ravel())
        lens.append(np.full(len(rg) * n, run, dtype=np.int64))
    return merge_intervals(np.concatenate(regs), np.concatenate(offs), np.concatenate(lens))
