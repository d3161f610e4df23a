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
or ``Flat`` (defined here, with the model they describe) and ``planner.compiler`` turns the
declaration into pieces (``local_tensor``, ``LayoutBuilder``).
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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


def check_ints(values: Iterable[int], what: str) -> Shape:
    """``values`` as a tuple of non-negative integers; ``LayoutError`` (naming ``what``) otherwise."""
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
# Declarations: how users describe a local tensor. ``planner.compiler`` turns each into pieces.
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
        object.__setattr__(self, "global_shape", check_ints(self.global_shape, f"{self.name} global_shape"))
        if self.offsets is not None:
            object.__setattr__(self, "offsets", check_ints(self.offsets, f"{self.name} offsets"))
        if self.sizes is not None:
            object.__setattr__(self, "sizes", check_ints(self.sizes, f"{self.name} sizes"))


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
            segments.append((n, check_ints(shape, f"{n} global_shape"), *check_ints((a, b), f"{n} segment bounds")))
        object.__setattr__(self, "segments", tuple(segments))


Declaration = Shard | Fused | Stack | Flat
