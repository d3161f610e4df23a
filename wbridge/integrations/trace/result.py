"""Trace results as plain data: ``TraceResult`` (entries per parameter), its JSON form and cache."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.layout import Declaration, Flat, Fused, Shard, Stack, TensorSpec

from ...errors import LayoutError
from ...protocol.declarations import decl_from_dict, decl_to_dict

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


def traced(
    cache_dir: str | None,
    trace: Callable[[], TraceResult],
    model_config: Any,
    engine: str,
    engine_version: str,
    rank: int,
    shapes: Mapping[str, Sequence[int]],
    **parallel: Any,
) -> TraceResult:
    """``trace()``, cached in ``cache_dir`` (None: not cached) under the key of all that changes an
    engine's layout: its model config (``hf_config``, ``dtype``, ``quantization``), the engine and
    its version, the rank, the canonical ``shapes`` and ``parallel`` (tp, pp, ep sizes)."""
    if cache_dir is None:
        return trace()
    key = cache_key(
        model_config.hf_config.to_dict(),
        engine,
        engine_version,
        rank,
        dtype=str(model_config.dtype),
        quantization=getattr(model_config, "quantization", None),
        canonical=sorted(shapes.items()),
        **parallel,
    )
    return cached_trace(cache_dir, key, trace)
