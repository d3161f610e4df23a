"""The JSON form of layout declarations (trace caches, subscriber layout records)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.layout import Declaration, Flat, Fused, Shard, Stack

from ..errors import LayoutError

__all__ = ["decl_to_dict", "decl_from_dict"]


def _shard_to_list(s: Shard) -> list:
    return [
        s.name,
        list(s.global_shape),
        None if s.offsets is None else list(s.offsets),
        None if s.sizes is None else list(s.sizes),
        bool(s.padded),
    ]


def _shard_from_list(x: Sequence) -> Shard:
    name, g, o, sz, pad = x
    return Shard(name, tuple(g), None if o is None else tuple(o), None if sz is None else tuple(sz), bool(pad))


def decl_to_dict(decl: Declaration) -> dict:
    """A JSON-ready form of a declaration (inverse: ``decl_from_dict``)."""
    if isinstance(decl, Shard):
        return {"shard": _shard_to_list(decl)}
    if isinstance(decl, Fused):
        return {"fused": decl.dim, "parts": [_shard_to_list(p) for p in decl.parts]}
    if isinstance(decl, Stack):
        return {"stack": [_shard_to_list(p) for p in decl.parts]}
    if isinstance(decl, Flat):
        return {"flat": [[n, list(s), a, b] for n, s, a, b in decl.segments]}
    raise LayoutError(f"unknown declaration {decl!r}")


def decl_from_dict(d: Mapping) -> Declaration:
    try:
        if "shard" in d:
            return _shard_from_list(d["shard"])
        if "fused" in d:
            return Fused(int(d["fused"]), tuple(_shard_from_list(p) for p in d["parts"]))
        if "stack" in d:
            return Stack(tuple(_shard_from_list(p) for p in d["stack"]))
        if "flat" in d:
            return Flat(tuple((n, tuple(s), int(a), int(b)) for n, s, a, b in d["flat"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutError(f"malformed declaration record {d!r}: {e}") from e
    raise LayoutError(f"malformed declaration record {d!r}")
