"""The declaration compiler: turns ``Shard`` / ``Fused`` / ``Stack`` / ``Flat`` declarations into pieces.

``pieces_for`` compiles one declaration for a local tensor of a given shape (checking that the
pieces fit the canonical shapes and do not overlap in the local tensor), ``local_tensor`` wraps the
result in a ``LocalTensor``, ``specs_of`` names the canonical tensors a declaration refers to, and
``LayoutBuilder`` places a rank's declared tensors in regions and returns its ``RankLayout``. The
model these produce (boxes, pieces, local tensors, rank layouts) is ``planner.layout``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .dtypes import itemsize as _itemsize
from .errors import LayoutError
from .layout import (
    Box,
    Declaration,
    Flat,
    Fused,
    LocalTensor,
    Piece,
    RankLayout,
    Shape,
    Shard,
    Stack,
    TensorSpec,
    check_ints,
    row_major_strides,
)


def _shard_pieces(name: str, decl: Shard, local_shape: Shape, base: int, strides: Shape) -> list[Piece]:
    g = decl.global_shape
    offsets = decl.offsets if decl.offsets is not None else (0,) * len(g)
    sizes = decl.sizes if decl.sizes is not None else local_shape
    if len(offsets) != len(g):
        raise LayoutError(f"{name}: offsets {offsets} do not match {decl.name} of shape {g}")
    if len(sizes) != len(g):
        raise LayoutError(
            f"{name}: local shape {sizes} has rank {len(sizes)} but canonical "
            f"{decl.name} has shape {g}; give Shard(sizes=...)"
        )
    same_shape = tuple(sizes) == tuple(local_shape)
    if not same_shape and math.prod(sizes) != math.prod(local_shape):
        raise LayoutError(f"{name}: box sizes {sizes} of {decl.name} do not fit local shape {local_shape}")
    box_strides = strides if same_shape else row_major_strides(sizes)
    box = Box(offsets, sizes)
    if box.within(g):
        return [Piece(decl.name, box, base, box_strides)]
    if not decl.padded:
        raise LayoutError(
            f"{name}: box offsets={offsets} sizes={sizes} runs outside {decl.name} of "
            f"shape {g}; pass padded=True if the excess is padding"
        )
    if not same_shape:
        raise LayoutError(f"{name}: a padded shard must have the local tensor's shape")
    clipped = box.intersect(Box((0,) * len(g), g))
    if clipped is None:
        return []
    shift = sum((c - o) * s for c, o, s in zip(clipped.offsets, offsets, box_strides))
    return [Piece(decl.name, clipped, base + shift, box_strides)]


def _fused_pieces(name: str, decl: Fused, local_shape: Shape) -> list[Piece]:
    d = decl.dim
    if not 0 <= d < len(local_shape):
        raise LayoutError(f"{name}: fused dim {d} out of range for local shape {local_shape}")
    strides = row_major_strides(local_shape)
    fixed = sum(p.sizes[d] for p in decl.parts if p.sizes is not None)
    free = [p for p in decl.parts if p.sizes is None]
    left = local_shape[d] - fixed
    weight = sum(p.global_shape[d] for p in free)
    extents: list[int] = []
    for p in decl.parts:
        if p.sizes is not None:
            extents.append(p.sizes[d])
            continue
        share = left * p.global_shape[d]
        if weight == 0 or share % weight:
            raise LayoutError(
                f"{name}: cannot split {left} rows of dim {d} among fused parts "
                f"{[q.name for q in free]} in proportion; give Shard(sizes=...)"
            )
        extents.append(share // weight)
    if sum(extents) != local_shape[d]:
        raise LayoutError(f"{name}: fused parts span {sum(extents)} along dim {d}, local has {local_shape[d]}")
    pieces: list[Piece] = []
    start = 0
    for p, ext in zip(decl.parts, extents):
        part_shape = tuple(ext if i == d else s for i, s in enumerate(local_shape))
        sizes = p.sizes if p.sizes is not None else part_shape
        if tuple(sizes) != part_shape:
            raise LayoutError(f"{name}: fused part {p.name} has sizes {sizes}, expected {part_shape}")
        part = Shard(p.name, p.global_shape, p.offsets, part_shape, p.padded)
        pieces += _shard_pieces(name, part, part_shape, start * strides[d], strides)
        start += ext
    return pieces


def pieces_for(name: str, decl: Declaration, local_shape: Sequence[int]) -> tuple[Piece, ...]:
    """The pieces a declaration gives a local tensor of ``local_shape`` (named ``name`` in errors)."""
    shape = check_ints(local_shape, f"{name} shape")
    if isinstance(decl, Shard):
        pieces = _shard_pieces(name, decl, shape, 0, row_major_strides(shape))
    elif isinstance(decl, Fused):
        pieces = _fused_pieces(name, decl, shape)
    elif isinstance(decl, Stack):
        if not shape or shape[0] != len(decl.parts):
            raise LayoutError(
                f"{name}: Stack of {len(decl.parts)} parts needs a leading dim of that size, local shape is {shape}"
            )
        inner = shape[1:]
        step = math.prod(inner)
        pieces = []
        for i, p in enumerate(decl.parts):
            if isinstance(p, Fused):
                pieces += [
                    Piece(q.tensor, q.box, q.offset + i * step, q.strides) for q in _fused_pieces(name, p, inner)
                ]
                continue
            part = Shard(p.name, p.global_shape, p.offsets, p.sizes if p.sizes is not None else inner)
            pieces += _shard_pieces(name, part, inner, i * step, row_major_strides(inner))
    elif isinstance(decl, Flat):
        if len(shape) != 1:
            raise LayoutError(f"{name}: a Flat local tensor must be 1-D, got shape {shape}")
        pieces = []
        pos = 0
        for tname, gshape, a, b in decl.segments:
            if not 0 <= a <= b <= math.prod(gshape):
                raise LayoutError(f"{name}: flat range [{a}, {b}) outside {tname} of shape {gshape}")
            pieces += [
                Piece(tname, box, pos + off, row_major_strides(gshape)) for box, off in flat_range_boxes(gshape, a, b)
            ]
            pos += b - a
        if pos > shape[0]:
            raise LayoutError(f"{name}: flat segments hold {pos} elements, local tensor has {shape[0]}")
    else:
        raise LayoutError(f"{name}: unknown declaration {decl!r}")
    _check_disjoint(name, pieces, shape)
    return tuple(pieces)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """Cuts the row-major element range ``[start, stop)`` of ``shape`` into boxes.

    Returns ``(box, position)`` pairs, ``position`` being the box's first element's index within
    the range. At most ``2 * ndim - 1`` boxes.
    """
    shape = tuple(int(s) for s in shape)
    out: list[tuple[Box, int]] = []
    if start >= stop:
        return out
    if not shape:
        return [(Box((), ()), 0)]
    strides = row_major_strides(shape)

    def rec(dim: int, prefix: tuple[int, ...], a: int, b: int, pos: int) -> None:
        # [a, b) is an element range inside the sub-tensor indexed by prefix (rank len(shape)-dim).
        inner = strides[dim]
        n = shape[dim]
        if a % inner == 0 and b % inner == 0:
            lo, hi = a // inner, b // inner
            sizes = (1,) * len(prefix) + (hi - lo,) + shape[dim + 1 :]
            out.append((Box(prefix + (lo,) + (0,) * (len(shape) - dim - 1), sizes), pos))
            return
        lo, hi = a // inner, (b - 1) // inner
        if lo == hi:
            rec(dim + 1, prefix + (lo,), a - lo * inner, b - lo * inner, pos)
            return
        head_end = (lo + 1) * inner
        if a % inner:
            rec(dim + 1, prefix + (lo,), a - lo * inner, inner, pos)
        else:
            head_end = a
        tail_start = hi * inner
        if b % inner == 0:
            tail_start = b
        if tail_start > head_end:
            rows = (tail_start - head_end) // inner
            sizes = (1,) * len(prefix) + (rows,) + shape[dim + 1 :]
            out.append((Box(prefix + (head_end // inner,) + (0,) * (len(shape) - dim - 1), sizes), pos + head_end - a))
        if tail_start < b:
            rec(dim + 1, prefix + (hi,), 0, b - tail_start, pos + tail_start - a)
        del n

    rec(0, (), start, stop, 0)
    return out


def _check_disjoint(name: str, pieces: Sequence[Piece], shape: Shape) -> None:
    numel = math.prod(shape)
    total = 0
    spans = []
    for p in pieces:
        lo, hi = p.local_extent()
        if p.box.numel and (lo < 0 or hi > numel):
            raise LayoutError(f"{name}: piece of {p.tensor} {p.box} lands outside the local tensor")
        total += p.box.numel
        spans.append((lo, hi, p))
    if total > numel:
        raise LayoutError(f"{name}: pieces map {total} elements into a local tensor of {numel}")
    spans.sort(key=lambda s: s[0])
    for (alo, ahi, a), (blo, bhi, b) in itertools.pairwise(spans):
        # Only dense (row-major contiguous) pieces can be checked cheaply; overlaps of strided
        # pieces with holes (fused parts) are excluded by construction of the declarations.
        if blo < ahi and ahi - alo == a.box.numel and bhi - blo == b.box.numel:
            raise LayoutError(f"{name}: pieces of {a.tensor} and {b.tensor} overlap in the local tensor")


def local_tensor(
    name: str, shape: Sequence[int], dtype: str, decl: Declaration, *, region: int = 0, offset: int = 0
) -> LocalTensor:
    """Builds a ``LocalTensor`` from a declaration."""
    shape_t = check_ints(shape, f"{name} shape")
    return LocalTensor(name, shape_t, dtype, int(region), int(offset), pieces_for(name, decl, shape_t))


def specs_of(decl: Declaration, dtype: str) -> list[TensorSpec]:
    """The canonical tensors a declaration refers to, with the local dtype as theirs."""
    if isinstance(decl, Shard):
        return [TensorSpec(decl.name, decl.global_shape, dtype)]
    if isinstance(decl, (Fused, Stack)):
        return [s for p in decl.parts for s in specs_of(p, dtype)]
    if isinstance(decl, Flat):
        return [TensorSpec(n, s, dtype) for n, s, _, _ in decl.segments]
    raise LayoutError(f"unknown declaration {decl!r}")


@dataclass
class LayoutBuilder:
    """Collects local tensors of one rank and packs them into regions.

    ``pack=True`` lays every tensor into region 0 back to back (aligned to ``align`` bytes), which is
    how a publisher's staging slot is laid out; ``pack=False`` gives each tensor a region of its own
    (live tensors registered in place).
    """

    rank: int
    pack: bool = True
    align: int = 64
    _tensors: list[LocalTensor] = field(default_factory=list)
    _specs: dict[str, TensorSpec] = field(default_factory=dict)
    _sizes: list[int] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)

    def add(self, name: str, shape: Sequence[int], dtype: str, decl: Declaration) -> LocalTensor:
        if name in self._names:  # a set: MoE layouts register tens of thousands of tensors
            raise LayoutError(f"rank {self.rank}: local tensor {name!r} registered twice")
        nbytes = math.prod(shape) * _itemsize(dtype)
        if self.pack:
            if not self._sizes:
                self._sizes.append(0)
            offset = -(-self._sizes[0] // self.align) * self.align
            region = 0
            self._sizes[0] = offset + nbytes
        else:
            region, offset = len(self._sizes), 0
            self._sizes.append(nbytes)
        t = local_tensor(name, shape, dtype, decl, region=region, offset=offset)
        for spec in specs_of(decl, dtype):
            prev = self._specs.get(spec.name)
            if prev is not None and prev != spec:
                raise LayoutError(
                    f"rank {self.rank}: canonical {spec.name} declared as {prev.shape}/"
                    f"{prev.dtype} and as {spec.shape}/{spec.dtype}"
                )
            self._specs[spec.name] = spec
        self._tensors.append(t)
        self._names.add(name)
        return t

    def build(self) -> RankLayout:
        return RankLayout(self.rank, tuple(self._tensors), tuple(self._specs.values()), tuple(self._sizes))
