"""Trace an engine's own ``load_weights`` to find where every canonical element lands.

How it works
------------
Each parameter of the module is swapped for a ``float64`` shadow filled with NaN. The engine's
``load_weights(iter[(hf_name, full_tensor)])`` then runs ``1 + max_ndim`` times on placeholders
that cost no memory: in pass 0 every element of canonical tensor ``t`` holds a random tag of ``t``
(an expanded scalar); in pass ``d + 1`` every element holds a random tag of its index along dim
``d`` (an expanded vector). Reading the shadows back gives, for each parameter element, which
canonical tensor and which index it came from, or NaN: never written (unmapped, e.g. vocabulary
padding). A value that is no tag at all means the loader computed something (a scale, a sum, a
cast), which is reported naming the parameter; tags are random, so any transform other than a
copy is caught. Canonical elements must land in increasing order inside each parameter; a loader
that permutes them otherwise (a transpose, a RoPE permutation) is reported as not a slicing.

The element map of each parameter is then compressed into planner declarations: ``Shard``
(possibly ``padded``), ``Fused`` along one dim, ``Stack`` or ``Flat``; where no single declaration
fits (a stacked ``[E, 2I, H]`` expert tensor holding ``[gate_e; up_e]`` per expert), the parameter is
split into views ``param[i]`` along dim 0, each declared on its own.

Results are plain data (``TraceResult``), cached as JSON keyed by model config, engine version and
rank (``cached_trace``), and can be replicated by name pattern: ``expand_layers`` copies the layout
of one traced decoder layer to every layer of the same kind, ``expand_experts`` the layout of the
traced experts to a full expert map, so a 1T-parameter model is extracted from a trace of a
two-layer, few-expert model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.layout import Declaration, Flat, Fused, Shard, Stack, TensorSpec

from ..errors import LayoutError
from ..protocol.declarations import decl_from_dict, decl_to_dict

View = tuple[int, ...]  # integer index into leading dims; () is the whole parameter


@dataclass(frozen=True)
class TraceResult:
    """Where each parameter's elements come from.

    ``entries[param]`` is a tuple of ``(view, decl)``: ``view`` indexes the parameter's leading
    dims (``()``: the whole parameter) and ``decl`` declares that view. ``unmapped[param]`` counts
    elements no canonical tensor reaches (padding); ``unused`` lists canonical tensors the loader
    read into no parameter (another rank's, or not needed)."""

    entries: Mapping[str, tuple[tuple[View, Declaration], ...]]
    unmapped: Mapping[str, int] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    seconds: float = 0.0

    def names(self) -> list[str]:
        return list(self.entries)

    def bind(self, tensors: Mapping[str, Any] | Any, *, sep: str = "#") -> dict[str, tuple[Any, Declaration]]:
        """``{local name: (tensor or view, decl)}`` for ``Publisher/Subscriber.register``.

        ``tensors`` is a module (its parameters by name) or a mapping of name to tensor with the
        traced shapes. A parameter declared through views yields one entry per view, named
        ``f"{param}{sep}{i}"``."""
        if not isinstance(tensors, Mapping):
            tensors = dict(tensors.named_parameters(remove_duplicate=False))
        out: dict[str, tuple[Any, Declaration]] = {}
        for name, items in self.entries.items():
            if name not in tensors:
                raise LayoutError(f"{name}: traced parameter not found among the tensors to bind")
            t = tensors[name]
            t = t.data if hasattr(t, "data") and hasattr(t, "requires_grad") else t
            for view, decl in items:
                v = t[view] if view else t
                out[name + (sep + sep.join(map(str, view)) if view else "")] = (v, decl)
        return out

    def canonical_names(self) -> set[str]:
        return {s.name for items in self.entries.values() for _, d in items for s in _shards(d)}

    def to_json(self) -> str:
        return json.dumps(
            {
                "entries": {k: [[list(v), decl_to_dict(d)] for v, d in items] for k, items in self.entries.items()},
                "unmapped": dict(self.unmapped),
                "unused": list(self.unused),
                "seconds": self.seconds,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TraceResult:
        try:
            d = json.loads(text)
            return cls(
                {k: tuple((tuple(v), decl_from_dict(dd)) for v, dd in items) for k, items in d["entries"].items()},
                {k: int(v) for k, v in d["unmapped"].items()},
                tuple(d["unused"]),
                float(d["seconds"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise LayoutError(f"malformed trace record: {e}") from e


def _shards(decl: Declaration) -> list[Shard]:
    if isinstance(decl, Shard):
        return [decl]
    if isinstance(decl, (Fused, Stack)):
        return list(decl.parts)
    if isinstance(decl, Flat):
        return [Shard(n, s) for n, s, _, _ in decl.segments]
    raise LayoutError(f"unknown declaration {decl!r}")


# ---------------------------------------------------------------------------------------------
# Canonical tensors and tags
# ---------------------------------------------------------------------------------------------


def canonical_shapes(canonical: Any) -> dict[str, tuple[int, ...]]:
    """Accepts ``{name: shape}``, ``{name: tensor}`` or an iterable of ``TensorSpec``."""
    out: dict[str, tuple[int, ...]] = {}
    items = (
        canonical.items()
        if isinstance(canonical, Mapping)
        else ((s.name, s.shape) for s in canonical if isinstance(s, TensorSpec))
    )
    for name, v in items:
        shape = getattr(v, "shape", v)
        out[str(name)] = tuple(int(x) for x in shape)
    if not out:
        raise LayoutError("no canonical tensors given")
    return out


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


def _owner(module: Any, name: str) -> tuple[Any, str]:
    mod = module
    *path, attr = name.split(".")
    for p in path:
        mod = getattr(mod, p)
    return mod, attr


def _getattr_path(module: Any, name: str) -> Any:
    owner, attr = _owner(module, name)
    return getattr(owner, attr)


def _stand_in(p: Any, data: Any) -> Any:
    """A parameter object like ``p`` (class, attributes such as ``weight_loader``) holding ``data``."""
    import torch

    new = torch.nn.Parameter(data, requires_grad=False)
    new.__dict__.update(p.__dict__)
    if type(p) is not torch.nn.Parameter:
        new.__class__ = type(p)
    return new


class _Shadowed:
    """Swaps the traced parameters for float64 NaN shadows (fresh ones before every pass, since
    some loaders replace a parameter with the tensor they were given) and parks every other
    parameter as a meta-device stand-in (the loader's copies into it cost nothing and cannot
    touch real weights); restores the originals on exit."""

    def __init__(self, module: Any, names: Sequence[str]) -> None:
        self.module = module
        self.params = dict(module.named_parameters())
        self.names = list(names)
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _Shadowed:
        import torch

        chosen = set(self.names)
        for n, p in self.params.items():
            self.saved[n] = p.data if p.device.type != "meta" else None
            if n not in chosen and p.device.type != "meta":
                owner, attr = _owner(self.module, n)
                setattr(owner, attr, _stand_in(p, torch.empty(p.shape, dtype=p.dtype, device="meta")))
        return self

    def reset(self) -> None:
        import torch

        for n in self.names:
            p = self.params[n]
            owner, attr = _owner(self.module, n)
            shadow = torch.full(tuple(p.shape), float("nan"), dtype=torch.float64)
            if p.device.type == "meta":
                setattr(owner, attr, _stand_in(p, shadow))
            else:
                p.data = shadow
                if getattr(owner, attr) is not p:
                    setattr(owner, attr, p)

    def current(self) -> dict[str, Any]:
        # By name, not by the objects swapped in: some loaders replace parameters instead of copying.
        return {n: _getattr_path(self.module, n) for n in self.names}

    def __exit__(self, *exc: Any) -> None:
        for n, p in self.params.items():
            owner, attr = _owner(self.module, n)
            if self.saved[n] is not None:
                p.data = self.saved[n]
            setattr(owner, attr, p)


def _groups(names: Sequence[str], params: Mapping[str, Any], max_bytes: int | None) -> list[list[str]]:
    if not max_bytes:
        return [list(names)]
    out: list[list[str]] = [[]]
    size = 0
    for n in names:
        b = 8 * math.prod(params[n].shape)
        if out[-1] and size + b > max_bytes:
            out.append([])
            size = 0
        out[-1].append(n)
        size += b
    return out


def _run(load_weights: Callable, tags: _Tags, pass_no: int, order: Sequence[int]) -> None:
    try:
        load_weights((tags.names[i], tags.placeholder(i, pass_no)) for i in order)
    except LayoutError:
        raise
    except Exception as e:  # noqa: BLE001 - the loader is foreign code; name what it was doing
        raise LayoutError(f"load_weights failed while tracing (pass {pass_no}): {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Compression of element maps into declarations
# ---------------------------------------------------------------------------------------------


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
    from planner.layout import pieces_for, row_major_strides

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


def trace_load_weights(
    module: Any,
    load_weights: Callable[[Iterable[tuple[str, Any]]], Any],
    canonical: Any,
    *,
    params: Sequence[str] | None = None,
    allow_unmapped: Sequence[str] = (r"embed", r"lm_head"),
    require_all: bool = True,
    seed: int = 0,
    max_group_bytes: int | None = None,
) -> TraceResult:
    """Runs ``load_weights`` on index-encoded placeholders and returns where everything landed.

    ``canonical``: the canonical tensors with shapes (``{name: shape}``, ``{name: tensor}`` or
    ``TensorSpec``s); each is fed to ``load_weights`` as ``(name, full_tensor)``, in that order.
    ``params``: the parameters to trace (default: all of ``module``'s). Parameters that receive
    nothing raise ``LayoutError`` naming them (a missing tensor) unless ``require_all=False``;
    partially written ones are allowed only where a pattern of ``allow_unmapped`` matches the name
    (vocabulary padding) and the written part is a padded shard. A loader that transforms values
    or permutes them is reported naming the parameter. The module's parameters are restored
    afterwards (their values untouched); parameters not traced are parked on the meta device
    meanwhile, so the loader never writes into real weights. ``max_group_bytes`` bounds the
    shadow memory: parameters are traced in groups of at most that many float64 bytes, the
    loader running once per pass per group (it costs little: inputs are expanded views).
    """
    t0 = time.perf_counter()
    shapes = canonical_shapes(canonical)
    tags = _Tags(shapes, seed)
    names = tags.names
    all_params = dict(module.named_parameters())  # tied parameters once, by their first name
    chosen = list(params) if params is not None else list(all_params)
    for n in chosen:
        if n not in all_params:
            raise LayoutError(f"{n}: no such parameter in {type(module).__name__}")
    order = list(range(len(names)))
    result: dict[str, tuple[tuple[View, Declaration], ...]] = {}
    unmapped: dict[str, int] = {}
    used: set[int] = set()
    for group in _groups(chosen, all_params, max_group_bytes):
        maps = _trace_group(module, load_weights, tags, group, order)
        for n in group:
            m = maps.pop(n)
            used.update(t for t in _ids(m.tid) if t >= 0)
            k = int((m.tid < 0).sum())
            if k == m.tid.size:
                # A rank whose whole vocabulary shard is padding is fine; any other empty parameter
                # means the loader never received (or never recognized) its tensor.
                if require_all and not any(re.search(p, n) for p in allow_unmapped):
                    raise LayoutError(
                        f"{n}: load_weights wrote nothing into this parameter (a canonical tensor "
                        f"is missing or its name is not what the loader expects)"
                    )
                unmapped[n] = k
                continue
            try:
                items = _declare(n, m, names, tags.shapes)
            except LayoutError:
                _check_order(n, m, names, tags.shapes)  # the clearer message, if it applies
                raise
            if not _pieces_ordered(n, tuple(all_params[n].shape), items):
                _check_order(n, m, names, tags.shapes)  # exact element check on the rare doubt
            if k:
                unmapped[n] = k
                padded = all(isinstance(d, Shard) and d.padded for _, d in items)
                if not (padded and any(re.search(p, n) for p in allow_unmapped)):
                    raise LayoutError(
                        f"{n}: load_weights left {k} of {m.tid.size} elements unwritten "
                        f"(a missing tensor or a partial copy); allow_unmapped patterns "
                        f"{list(allow_unmapped)}"
                    )
            result[n] = tuple(items)
            del m
    unused = tuple(names[i] for i in range(len(names)) if i not in used)
    return TraceResult(result, unmapped, unused, time.perf_counter() - t0)


def _trace_group(
    module: Any, load_weights: Callable, tags: _Tags, group: Sequence[str], order: Sequence[int]
) -> dict[str, _Map]:
    """Runs the passes for one group of parameters and decodes each pass as it comes (the float
    shadows of one pass are dropped before the next), returning each parameter's element map."""
    shapes = {}
    tids: dict[str, np.ndarray] = {}
    coords: dict[str, np.ndarray] = {}
    with _Shadowed(module, group) as sh:
        for n in group:
            shapes[n] = tuple(sh.params[n].shape)
        for pass_no in range(1 + tags.max_ndim):
            sh.reset()
            _run(load_weights, tags, pass_no, order)
            for n, p in sh.current().items():
                if str(p.dtype) != "torch.float64" or tuple(p.shape) != shapes[n]:
                    raise LayoutError(
                        f"{n}: load_weights replaced the parameter with a {p.dtype} tensor of "
                        f"shape {tuple(p.shape)}; it must copy into the existing parameter"
                    )
                v = p.detach().reshape(-1).numpy()
                if pass_no == 0:
                    tids[n] = _decode_tensor(n, shapes[n], v, tags)
                    coords[n] = np.zeros((max(tags.max_ndim, 1), v.size), dtype=np.int32)
                else:
                    _decode_dim(n, shapes[n], v, tags, tids[n], coords[n], pass_no - 1)
    return {n: _Map(shapes[n], tids[n], coords[n]) for n in group}


def _decode_tensor(name: str, shape: tuple[int, ...], v0: np.ndarray, tags: _Tags) -> np.ndarray:
    tid = _lookup(v0, tags.tensor)  # NaN (never written) matches no tag: -1
    bad = (tid < 0) & ~np.isnan(v0)
    if bad.any():
        i = int(np.argmax(bad))
        raise LayoutError(
            f"{name}: element {tuple(int(x) for x in np.unravel_index(i, shape))} holds {v0[i]!r}, "
            f"which is no canonical element: load_weights transforms values (a scale, a sum, a cast) "
            f"instead of copying"
        )
    return tid


def _decode_dim(
    name: str, shape: tuple[int, ...], v: np.ndarray, tags: _Tags, tid: np.ndarray, coords: np.ndarray, d: int
) -> None:
    ids = _ids(tid)
    for t in ids:
        if t < 0 or d >= len(tags.dims[t]):
            continue
        sel = _select(tid, t, ids)
        ix = _lookup(v[sel], tags.dims[t][d])
        if (ix < 0).any():
            i = int(np.arange(tid.size)[sel][int(np.argmax(ix < 0))])
            raise LayoutError(
                f"{name}: element {tuple(int(x) for x in np.unravel_index(i, shape))} from "
                f"{tags.names[t]} holds a value that is no index tag: load_weights transforms values "
                f"instead of copying (or writes {tags.names[t]} inconsistently)"
            )
        coords[d, sel] = ix


# ---------------------------------------------------------------------------------------------
# Replication by name pattern
# ---------------------------------------------------------------------------------------------


def _subst(text: str, pattern: str, old: int, new: int) -> str:
    return text.replace(pattern.format(old), pattern.format(new))


def _rename_decl(decl: Declaration, fn: Callable[[str], str]) -> Declaration:
    if isinstance(decl, Shard):
        return Shard(fn(decl.name), decl.global_shape, decl.offsets, decl.sizes, decl.padded)
    if isinstance(decl, Fused):
        return Fused(decl.dim, tuple(_rename_decl(p, fn) for p in decl.parts))
    if isinstance(decl, Stack):
        return Stack(tuple(_rename_decl(p, fn) for p in decl.parts))
    return Flat(tuple((fn(n), s, a, b) for n, s, a, b in decl.segments))


def expand_layers(result: TraceResult, layers: Mapping[int, int], *, pattern: str = "layers.{}.") -> TraceResult:
    """Replicates traced decoder layers by name: ``layers[target] = traced source layer``.

    Every parameter and canonical name containing ``pattern.format(source)`` is copied for each
    target. Parameters outside any layer are kept as they are."""
    by_layer: dict[int, list[str]] = {}
    rx = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
    keep: dict[str, tuple] = {}
    for name, items in result.entries.items():
        mt = rx.search(name)
        if mt is None:
            keep[name] = items
        else:
            by_layer.setdefault(int(mt.group(1)), []).append(name)
    out = dict(keep)
    unmapped = {k: v for k, v in result.unmapped.items() if rx.search(k) is None}
    for tgt, src in layers.items():
        if src not in by_layer:
            raise LayoutError(f"layer {src} (source of layer {tgt}) was not traced")
        fn = lambda s, a=src, b=tgt: _subst(s, pattern, a, b)  # noqa: E731
        for name in by_layer[src]:
            out[fn(name)] = tuple((v, _rename_decl(d, fn)) for v, d in result.entries[name])
            if name in result.unmapped:
                unmapped[fn(name)] = result.unmapped[name]
    return TraceResult(out, unmapped, (), result.seconds)


def expand_experts(
    result: TraceResult,
    traced_map: Sequence[int],
    full_map: Sequence[int],
    *,
    pattern: str = "experts.{}.",
    resize: Mapping[str, int] | None = None,
) -> TraceResult:
    """Replicates traced experts: local slot ``j`` held expert ``traced_map[j]`` in the trace and
    holds ``full_map[j]`` in the full model.

    Stacked expert parameters (declared per view ``param[j]``) get one view per full slot; the
    canonical names' ``experts.{e}.`` are rewritten. The trace must show slot ``j`` holding
    ``traced_map[j]`` (checked), which is how the pattern is verified rather than assumed."""
    rx = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)"))
    slot_of = {e: j for j, e in enumerate(traced_map)}
    out: dict[str, tuple] = {}
    for name, items in result.entries.items():
        experts_here = {int(m.group(1)) for _, d in items for s in _shards(d) for m in [rx.search(s.name)] if m}
        if not experts_here:
            out[name] = items
            continue
        as_stack = len(items) == 1 and items[0][0] == () and isinstance(items[0][1], Stack)
        if as_stack:
            items = tuple(((j,), p) for j, p in enumerate(items[0][1].parts))
        if not all(len(v) >= 1 for v, _ in items):
            raise LayoutError(f"{name}: expert weights are not declared per stacked slot; cannot replicate by pattern")
        template: dict[int, list[tuple[View, Declaration]]] = {}
        for v, d in items:
            es = {int(m.group(1)) for s in _shards(d) for m in [rx.search(s.name)] if m}
            if len(es) != 1:
                raise LayoutError(f"{name}[{v[0]}]: a slot mixes experts {sorted(es)}")
            e = es.pop()
            if slot_of.get(e) != v[0]:
                raise LayoutError(
                    f"{name}: slot {v[0]} holds expert {e}, but the traced expert map says "
                    f"{traced_map[v[0]] if v[0] < len(traced_map) else None}"
                )
            template.setdefault(v[0], []).append((v[1:], d))
        j0 = min(template)
        e0 = traced_map[j0]
        new = []
        for j, e in enumerate(full_map):
            fn = lambda s, a=e0, b=e: _subst(s, pattern, a, b)  # noqa: E731
            new += [((j,) + rest, _rename_decl(d, fn)) for rest, d in template[j0]]
        out[name] = (((), Stack(tuple(d for _, d in new))),) if as_stack else tuple(new)
    return TraceResult(out, dict(result.unmapped), (), result.seconds)


def with_shapes(result: TraceResult, shapes: Mapping[str, Sequence[int]]) -> TraceResult:
    """Checks an expanded trace against the full model's canonical shapes and updates tensors
    whose shape follows the replicated counts (a router ``[E, H]`` held whole). A tensor held only
    in part whose shape changed cannot be inferred: ``LayoutError`` names it."""

    def fix(s: Shard) -> Shard:
        if s.name not in shapes:
            raise LayoutError(f"{s.name}: produced by replication but not a tensor of the full model")
        g = tuple(int(x) for x in shapes[s.name])
        if g == s.global_shape:
            return s
        whole = (s.offsets is None or not any(s.offsets)) and (s.sizes is None or s.sizes == s.global_shape)
        if not whole or s.padded:
            raise LayoutError(
                f"{s.name}: shape {s.global_shape} in the trace, {g} in the full model, and "
                f"the trace holds only part of it; trace a config where it keeps its shape"
            )
        return Shard(s.name, g, s.offsets, None if s.sizes is None else g)

    def walk(d: Declaration) -> Declaration:
        if isinstance(d, Shard):
            return fix(d)
        if isinstance(d, Fused):
            return Fused(d.dim, tuple(fix(p) for p in d.parts))
        if isinstance(d, Stack):
            return Stack(tuple(fix(p) for p in d.parts))
        for n, g, _, _ in d.segments:
            if tuple(shapes.get(n, ())) != tuple(g):
                raise LayoutError(f"{n}: flat segments cannot be replicated to shape {shapes.get(n)}")
        return d

    return TraceResult(
        {k: tuple((v, walk(d)) for v, d in items) for k, items in result.entries.items()},
        dict(result.unmapped),
        (),
        result.seconds,
    )


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def cache_key(model_config: Mapping[str, Any], engine: str, engine_version: str, rank: int, **extra: Any) -> str:
    """A stable key for a trace: model config, engine name and version, rank, and anything else
    that changes the layout (tp size, ep size, quantization)."""
    blob = json.dumps(
        {"config": model_config, "engine": engine, "version": engine_version, "rank": rank, **extra},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached_trace(directory: str, key: str, trace: Callable[[], TraceResult]) -> TraceResult:
    """Returns the trace stored under ``key`` in ``directory`` or computes and stores it."""
    path = os.path.join(directory, f"trace-{key}.json")
    if os.path.exists(path):
        with open(path, "rb") as f:
            return TraceResult.from_json(f.read())
    result = trace()
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(result.to_json())
    os.replace(tmp, path)
    return result


def check_declarations(
    declared: Mapping[str, Declaration], traced: TraceResult, shapes: Mapping[str, Sequence[int]]
) -> None:
    """Raises ``LayoutError`` naming the first parameter whose hand-written declaration places
    canonical elements differently from what the engine's loader does (a wrong fusion order,
    a stale name after an engine upgrade, a wrong TP offset)."""
    from planner.layout import pieces_for

    for name, decl in declared.items():
        items = traced.entries.get(name)
        if items is None:
            raise LayoutError(f"{name}: declared, but the traced loader fills no such parameter")
        if len(items) != 1 or items[0][0] != ():
            raise LayoutError(
                f"{name}: the loader fills it per view {[v for v, _ in items][:4]}..., not as one declaration"
            )
        shape = tuple(shapes[name])
        want = sorted(pieces_for(name, items[0][1], shape), key=lambda p: p.offset)
        got = sorted(pieces_for(name, decl, shape), key=lambda p: p.offset)
        if want != got:
            w = [(p.tensor, p.box.offsets, p.box.sizes, p.offset) for p in want]
            g = [(p.tensor, p.box.offsets, p.box.sizes, p.offset) for p in got]
            raise LayoutError(
                f"{name}: declared layout differs from what load_weights does; loader places {w}, declaration says {g}"
            )
