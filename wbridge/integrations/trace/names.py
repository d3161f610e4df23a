"""Replicate a traced layout by name pattern (layers, experts), reshape it, and check declarations."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from planner.compiler import pieces_for
from planner.layout import Declaration, Flat, Fused, Shard, Stack

from ...errors import LayoutError
from .result import TraceResult, View, _shards


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


def check_declarations(
    declared: Mapping[str, Declaration], traced: TraceResult, shapes: Mapping[str, Sequence[int]]
) -> None:
    """Raises ``LayoutError`` naming the first parameter whose hand-written declaration places
    canonical elements differently from what the engine's loader does (a wrong fusion order,
    a stale name after an engine upgrade, a wrong TP offset)."""

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
