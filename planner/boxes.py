"""Sets of boxes in one tensor's index space: overlap test, grid refinement, box difference.

Boxes are half-open (``lo <= c < hi``), given as ``(n, ndim)`` integer arrays ``lo`` and ``hi``
(or as tuples for one box).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

Shape = tuple[int, ...]


def any_overlap(lo: np.ndarray, hi: np.ndarray) -> bool:
    """Whether any two of the boxes share an element (linear-ish sweep for very many boxes)."""
    n = len(lo)
    if n < 2:
        return False
    if n <= 16:
        los, his = lo.tolist(), hi.tolist()
        return any(
            all(max(a, b) < min(c, d) for a, b, c, d in zip(los[i], los[j], his[i], his[j]))
            for i in range(n)
            for j in range(i + 1, n)
        )
    if n > 4096:  # sweep on dim 0: only boxes overlapping there are compared
        order = np.argsort(lo[:, 0], kind="stable")
        lo, hi = lo[order], hi[order]
        for i in range(n):
            j = i + 1
            while j < n and lo[j, 0] < hi[i, 0]:
                if np.all(np.maximum(lo[i], lo[j]) < np.minimum(hi[i], hi[j])):
                    return True
                j += 1
        return False
    inter = np.all(np.maximum(lo[:, None, :], lo[None, :, :]) < np.minimum(hi[:, None, :], hi[None, :, :]), axis=2)
    np.fill_diagonal(inter, False)
    return bool(inter.any())


def grid_cells(lo: np.ndarray, hi: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Cuts the boxes along all their boundaries: yields ``(cell_lo, cell_hi, covers)`` for every
    grid cell inside at least one box, ``covers`` being the indices of the boxes holding it,
    in row-major order of the cells."""
    nd = lo.shape[1]
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(nd)]
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        c_lo = np.array([cuts[d][k] for d, k in enumerate(cell)], dtype=np.int64)
        c_hi = np.array([cuts[d][k + 1] for d, k in enumerate(cell)], dtype=np.int64)
        covers = np.flatnonzero(np.all((lo <= c_lo) & (hi >= c_hi), axis=1))
        if len(covers):
            yield c_lo, c_hi, covers


def subtract(lo: Shape, hi: Shape, cuts: Sequence[tuple[Shape, Shape]]) -> list[tuple[Shape, Shape]]:
    """The box ``[lo, hi)`` minus the boxes ``cuts``, as disjoint boxes (slabs along the outer
    dimensions first, so what is left of whole rows stays whole rows)."""
    left = [(tuple(lo), tuple(hi))]
    for clo, chi in cuts:
        nxt = []
        for blo, bhi in left:
            if any(max(a, b) >= min(c, d) for a, b, c, d in zip(blo, clo, bhi, chi)):
                nxt.append((blo, bhi))  # disjoint from this cut
                continue
            a, b = list(blo), list(bhi)
            for d in range(len(a)):
                if a[d] < clo[d]:
                    nxt.append((tuple(a), tuple(b[:d] + [clo[d]] + b[d + 1 :])))
                    a[d] = clo[d]
                if b[d] > chi[d]:
                    nxt.append((tuple(a[:d] + [chi[d]] + a[d + 1 :]), tuple(b)))
                    b[d] = chi[d]
        left = nxt
    return left
