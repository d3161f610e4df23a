"""Random tags that index-encode canonical tensors and their dims, and their lookup."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...errors import LayoutError


def _unique_tags(rng: np.random.Generator, n: int) -> np.ndarray:
    """Tag ``i`` is ``i + f_i`` with a random fraction ``f_i`` in [0.25, 0.75): the integer part
    decodes in O(1), the fraction (about 28 random bits) exposes any value transform."""
    if n >= 1 << 24:
        raise LayoutError(f"a dimension of {n} elements is too large to trace (limit {1 << 24})")
    return np.arange(n, dtype=np.float64) + 0.25 + 0.5 * rng.random(n)


class _Tags:
    def __init__(self, shapes: Mapping[str, tuple[int, ...]], seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.names = list(shapes)
        self.shapes = [shapes[n] for n in self.names]
        self.tensor = _unique_tags(rng, len(self.names))
        self.dims = [[_unique_tags(rng, s) for s in shape] for shape in self.shapes]
        self.max_ndim = max((len(s) for s in self.shapes), default=0)

    def placeholder(self, i: int, pass_no: int):
        import torch

        shape = self.shapes[i]
        if pass_no == 0 or pass_no - 1 >= len(shape):
            return torch.tensor(float(self.tensor[i]), dtype=torch.float64).expand(shape)
        d = pass_no - 1
        v = torch.from_numpy(self.dims[i][d].copy())  # a loader may adopt (and later overwrite) it
        view = [1] * len(shape)
        view[d] = shape[d]
        return v.view(view).expand(shape)


def _ids(tid: np.ndarray) -> list[int]:
    """The distinct tensor indices in ``tid`` (-1 included), in O(n) (``np.unique`` sorts)."""
    if tid.size == 0:
        return []
    lo, hi = int(tid.min()), int(tid.max())
    if lo == hi:  # the common case: one tensor (or none) fills the parameter
        return [lo]
    counts = np.bincount((tid + 1).astype(np.intp, copy=False))
    return [int(i) - 1 for i in np.flatnonzero(counts)]


def _select(tid: np.ndarray, t: int, ids: list[int]) -> np.ndarray | slice:
    return slice(None) if ids == [t] else np.nonzero(tid == t)[0]


CHUNK = 1 << 22  # elements per step of the large array passes (bounds temporaries)


def _lookup(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of each value in ``table`` (tags of ``_unique_tags``), -1 where it is none (NaN:
    never written; anything else: a transformed value)."""
    out = np.empty(values.shape, dtype=np.int32)
    n = len(table)
    with np.errstate(invalid="ignore"):
        for a in range(0, values.size, CHUNK):
            v = values[a : a + CHUNK]
            ok = (v >= 0) & (v < n)  # False for NaN
            idx = np.where(ok, v, 0).astype(np.int32)  # truncation: floor for v >= 0
            ok &= table[idx] == v
            out[a : a + CHUNK] = np.where(ok, idx, -1)
    return out


# ---------------------------------------------------------------------------------------------
# Running the loader on shadows
# ---------------------------------------------------------------------------------------------
