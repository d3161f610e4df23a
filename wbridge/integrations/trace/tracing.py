"""Run an engine's ``load_weights`` on index-encoded placeholders and read back where elements land."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.layout import Declaration, Shard

from ...errors import LayoutError
from .declare import _check_order, _declare, _Map, _pieces_ordered
from .result import TraceResult, View, canonical_shapes
from .tags import _ids, _lookup, _select, _Tags


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
