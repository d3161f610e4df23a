"""Layout metadata: which bytes of which canonical tensor each local tensor of a rank holds.

Model
-----
A *canonical tensor* (``TensorSpec``) is a full, unsharded tensor with a global name (a Hugging Face
parameter name, say), a global shape and a dtype. A *local tensor* is a contiguous buffer that lives
at a byte offset of a memory *region* of one rank. It is described by *pieces*: each piece maps a
box of one canonical tensor into the local tensor through element strides::

    local_element_index(c) = piece.offset + sum((c[i] - piece.box.offsets[i]) * piece.strides[i])

for every canonical index ``c`` inside ``piece.box``. This covers plain shards (strides are the local
row-major strides), fused tensors (several pieces at different offsets), stacked experts (a piece
per expert, the expert dimension dropped), reshaped views and flat FSDP-style shards (a row-major
element range cut into boxes). Local elements no piece covers are *unmapped*: never read, never
written (vocabulary padding, for example).

Users rarely build pieces by hand; they declare a local tensor with ``Shard``, ``Fused``, ``Stack``
or ``Flat`` and call ``local_tensor``.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .dtypes import itemsize as _itemsize
from .errors import LayoutError

Shape = tuple[int, ...]


def row_major_strides(shape: Sequence[int]) -> Shape:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * int(shape[i + 1])
    return tuple(strides)


def even_split(n: int, k: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of ``k`` near-equal consecutive parts of ``n``; the first ``n % k`` parts
    are one larger (Megatron/torch.chunk-style uneven splits start the same way)."""
    if k < 1:
        raise LayoutError(f"cannot split {n} into {k} parts")
    base, extra = divmod(int(n), int(k))
    out, o = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        out.append((o, size))
        o += size
    return out


def _int(value: object, what: str) -> int:
    """An integer (``operator.index``: a float, even 1.0, or a string is refused, never truncated)."""
    if isinstance(value, bool):
        raise LayoutError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{what} must be an integer, got {value!r}") from None


def _ints(values: Iterable[int], what: str) -> Shape:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise LayoutError(f"{what} must be a sequence of integers, got {values!r}")
    out = tuple(_int(v, what) for v in values)
    if any(v < 0 for v in out):
        raise LayoutError(f"{what} must be non-negative, got {out}")
    return out


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise LayoutError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _parts(parts: object, kinds: tuple[type, ...], what: str) -> tuple:
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Iterable):
        raise LayoutError(f"{what} must be a sequence of declarations, got {parts!r}")
    out = tuple(parts)
    for p in out:
        if not isinstance(p, kinds):
            raise LayoutError(f"{what}: {p!r} is not a {' or '.join(k.__name__ for k in kinds)}")
    return out


@dataclass(frozen=True)
class TensorSpec:
    """A canonical tensor: global name, global shape and dtype name (``bfloat16``, ``float32``...)."""

    name: str
    shape: Shape
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a tensor's index space: ``offsets[i] <= c[i] < offsets[i] + sizes[i]``."""

    offsets: Shape
    sizes: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise LayoutError(f"box offsets {self.offsets} and sizes {self.sizes} differ in rank")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        if other.ndim != self.ndim:
            raise LayoutError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(
            o >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape)
        )


@dataclass(frozen=True)
class Piece:
    """A box of canonical tensor ``tensor`` placed into a local tensor (see the module docstring)."""

    tensor: str
    box: Box
    offset: int
    strides: Shape

    def __post_init__(self) -> None:
        if len(self.strides) != self.box.ndim:
            raise LayoutError(
                f"piece of {self.tensor!r}: {len(self.strides)} strides for a box of rank {self.box.ndim}"
            )

    def local_extent(self) -> tuple[int, int]:
        """First and one-past-last local element index this piece touches."""
        last = self.offset + sum((s - 1) * st for s, st in zip(self.box.sizes, self.strides))
        return self.offset, last + 1


@dataclass(frozen=True)
class LocalTensor:
    """A contiguous local tensor of one rank: ``shape`` and ``dtype`` at byte ``offset`` of ``region``."""

    name: str
    shape: Shape
    dtype: str
    region: int
    offset: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def mapped_numel(self) -> int:
        return sum(p.box.numel for p in self.pieces)

    @property
    def unmapped_numel(self) -> int:
        return self.numel - self.mapped_numel


@dataclass(frozen=True)
class RankLayout:
    """Everything one rank holds: its local tensors, the canonical specs they refer to, its regions.

    ``region_sizes[r]`` is the byte size of region ``r``. For a publisher that stages into one
    buffer per slot, every local tensor is in region 0 and each slot is an identical copy of it.
    """

    rank: int
    tensors: tuple[LocalTensor, ...]
    specs: tuple[TensorSpec, ...]
    region_sizes: tuple[int, ...]

    def spec_map(self) -> dict[str, TensorSpec]:
        return {s.name: s for s in self.specs}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "region_sizes": list(self.region_sizes),
            "specs": [[s.name, list(s.shape), s.dtype] for s in self.specs],
            "tensors": [
                [
                    t.name,
                    list(t.shape),
                    t.dtype,
                    t.region,
                    t.offset,
                    [[p.tensor, list(p.box.offsets), list(p.box.sizes), p.offset, list(p.strides)] for p in t.pieces],
                ]
                for t in self.tensors
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> RankLayout:
        try:
            return cls(
                rank=int(d["rank"]),
                region_sizes=tuple(int(x) for x in d["region_sizes"]),
                specs=tuple(TensorSpec(n, tuple(s), dt) for n, s, dt in d["specs"]),
                tensors=tuple(
                    LocalTensor(
                        n,
                        tuple(sh),
                        dt,
                        int(reg),
                        int(off),
                        tuple(
                            Piece(pt, Box(tuple(po), tuple(ps)), int(pof), tuple(pst))
                            for pt, po, ps, pof, pst in pieces
                        ),
                    )
                    for n, sh, dt, reg, off, pieces in d["tensors"]
                ),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"malformed layout record: {e}") from e

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankLayout:
        return cls.from_dict(json.loads(text))


# ----------------------------------------------------------------------------------------------
# Declarations: how users describe a local tensor. Each turns into pieces given the local shape.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """The local tensor (or a part of a ``Fused``) is a box of canonical tensor ``name``.

    ``offsets=None`` means the box starts at the origin; ``sizes=None`` means the box has the local
    tensor's shape (inside ``Fused``: see there). When ``sizes`` has the same element count as the
    local tensor but another shape (a squeezed expert dimension, a flattened view) the box is laid
    out row-major in the local tensor. ``padded=True`` allows the box to run past the canonical
    shape (vocabulary padding): the part outside is unmapped and never touched.
    """

    name: str
    global_shape: Shape
    offsets: Shape | None = None
    sizes: Shape | None = None
    padded: bool = False

    def __post_init__(self) -> None:
        _name(self.name, "Shard name")
        object.__setattr__(self, "global_shape", _ints(self.global_shape, f"{self.name} global_shape"))
        if self.offsets is not None:
            object.__setattr__(self, "offsets", _ints(self.offsets, f"{self.name} offsets"))
        if self.sizes is not None:
            object.__setattr__(self, "sizes", _ints(self.sizes, f"{self.name} sizes"))


@dataclass(frozen=True)
class Fused:
    """The local tensor is the concatenation of ``parts`` (``Shard``s) along dimension ``dim``.

    A part without ``sizes`` takes the local extent of every other dimension; along ``dim`` the
    parts without sizes share what the parts with sizes leave, in proportion to their canonical
    extent along ``dim`` (how a TP-sliced ``[q; k; v]`` is laid out). Give ``sizes`` where that
    rule does not hold (GQA with kv heads replicated across TP ranks).
    """

    dim: int
    parts: tuple[Shard, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", _int(self.dim, "Fused dim"))
        object.__setattr__(self, "parts", _parts(self.parts, (Shard,), "Fused parts"))


@dataclass(frozen=True)
class Stack:
    """The local tensor stacks whole canonical tensors along a new leading dimension:
    ``local[i] == canonical(parts[i])`` (MoE experts held as one ``[E, ...]`` tensor).

    A part may itself be ``Fused`` (vLLM's ``w13_weight[e] = [gate_e; up_e]``).
    """

    parts: tuple[Shard | Fused, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", _parts(self.parts, (Shard, Fused), "Stack parts"))


@dataclass(frozen=True)
class Flat:
    """A 1-D local tensor holding row-major element ranges of canonical tensors, back to back.

    ``segments`` are ``(name, global_shape, start, stop)`` element ranges (FSDP1 flat parameters,
    which may cut a tensor mid-row and span several tensors).
    """

    segments: tuple[tuple[str, Shape, int, int], ...]

    def __post_init__(self) -> None:
        segments = []
        for seg in _parts(self.segments, (tuple, list), "Flat segments"):
            if len(seg) != 4:
                raise LayoutError(f"Flat segment {seg!r} is not (name, global_shape, start, stop)")
            n, shape, a, b = seg
            n = _name(n, "Flat segment name")
            segments.append((n, _ints(shape, f"{n} global_shape"), *_ints((a, b), f"{n} segment bounds")))
        object.__setattr__(self, "segments", tuple(segments))


Declaration = Shard | Fused | Stack | Flat


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
    shape = _ints(local_shape, f"{name} shape")
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
    shape_t = _ints(shape, f"{name} shape")
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
