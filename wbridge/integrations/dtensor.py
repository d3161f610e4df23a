"""Layout adapters: where a framework's local tensors sit inside the canonical (Hugging Face) tensors.

Each adapter returns ``{local_name: (local_tensor, declaration)}``, the argument that
``Publisher.register`` and ``Subscriber.register`` take. Declarations are the planner's
``Shard`` / ``Fused`` / ``Stack`` / ``Flat`` (see ``planner.layout``).

- ``from_dtensor``: DTensor state dicts (FSDP2 ``Shard(0)``, TP ``Shard(0)``/``Shard(1)``,
  ``Replicate``, 2-D meshes, FSDP2-over-TP ``_StridedShard``, uneven last shards).
- ``wbridge.integrations.megatron``: Megatron-style TP/PP/EP declarations (column/row-parallel, vocab-parallel,
  interleaved QKV, fused ``linear_fc1``).
- ``wbridge.integrations.trace``: the layout an engine's own ``load_weights`` produces, found by
  running it on index-encoded placeholders.
- ``from_module``: a plain, unsharded module whose parameter names are the canonical names
  (Hugging Face transformers models as trainers or rollout workers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from planner.layout import Declaration, Flat, Fused, Shard, Stack

from .. import _validate
from ..errors import LayoutError, UsageError

__all__ = ["from_dtensor", "from_module", "index_runs", "Declaration", "Shard", "Fused", "Stack", "Flat"]

Entry = tuple[Any, Declaration]


def index_runs(index: Sequence[int]) -> list[tuple[int, int]]:
    """Cuts a list of global indices into maximal runs of consecutive values: ``[(start, length)]``."""
    runs: list[tuple[int, int]] = []
    for i in index:
        i = int(i)
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _dtensor_indices(name: str, dt: Any) -> list[list[int] | None]:
    """Global indices along each tensor dim held by this rank (``None``: the whole dim).

    Applies the placements left to right as DTensor does, including ``_StridedShard`` (FSDP2 over a
    TP-sharded dim), whose local rows are not one contiguous range.
    """
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise LayoutError(f"{name}: this rank is not part of the DTensor's device mesh")
    shape = tuple(dt.shape)
    index: list[list[int] | None] = [None] * len(shape)
    for mesh_dim, pl in enumerate(dt.placements):
        if isinstance(pl, Replicate):
            continue
        if isinstance(pl, Partial):
            raise LayoutError(
                f"{name}: placement Partial on mesh dim {mesh_dim} holds an unreduced "
                f"partial sum, not a slice; reduce it (redistribute to Replicate/Shard) first"
            )
        if not isinstance(pl, (DShard, _StridedShard)):
            raise LayoutError(f"{name}: unsupported placement {pl!r} on mesh dim {mesh_dim}")
        d = pl.dim
        cur = index[d] if index[d] is not None else list(range(shape[d]))
        n, r = mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(pl, _StridedShard):
            size, offs = pl._local_shard_size_and_offset(len(cur), n, r, _StridedShardOffsetMode.ALL)
            picked = list(offs or [])[:size]
        else:
            size, off = pl._local_shard_size_and_offset(len(cur), n, r)
            picked = list(range(int(off), int(off) + int(size)))
        index[d] = [cur[i] for i in picked]
    return index


def _dtensor_decl(name: str, dt: Any, local_shape: tuple[int, ...]) -> Declaration:
    shape = tuple(int(s) for s in dt.shape)
    index = _dtensor_indices(name, dt)
    runs = {d: index_runs(ix) for d, ix in enumerate(index) if ix is not None}
    for d, ix in enumerate(index):
        if ix is not None and len(ix) != local_shape[d]:
            raise LayoutError(
                f"{name}: local shape {local_shape} does not match the {len(ix)} "
                f"indices DTensor placements {dt.placements} give dim {d}"
            )
    multi = [d for d, r in runs.items() if len(r) > 1]
    offsets = tuple(runs[d][0][0] if d in runs and runs[d] else 0 for d in range(len(shape)))
    if not multi:
        return Shard(name, shape, offsets)
    if len(multi) > 1:
        raise LayoutError(
            f"{name}: placements {dt.placements} give non-contiguous indices along dims "
            f"{multi}; only one such dim is supported"
        )
    d = multi[0]
    parts = []
    for start, length in runs[d]:
        offs = tuple(start if i == d else o for i, o in enumerate(offsets))
        sizes = tuple(length if i == d else s for i, s in enumerate(local_shape))
        parts.append(Shard(name, shape, offs, sizes))
    return Fused(d, tuple(parts))


def from_dtensor(
    named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    rename: Mapping[str, str] | None = None,
    skip_empty: bool = True,
) -> dict[str, Entry]:
    """The calling rank's layout of a state dict of DTensors (plain tensors are taken as whole).

    Returns ``{name: (local_tensor, decl)}`` where ``local_tensor`` is ``dt.to_local()`` (the live
    shard, not a copy) and ``decl`` places it in the canonical tensor ``rename.get(name, name)``.
    Ranks that hold an empty shard (uneven sharding: the last ranks may get nothing) leave the
    tensor out when ``skip_empty``. Raises ``LayoutError`` naming the tensor for ``Partial``
    placements and non-contiguous local shards.
    """
    import torch
    from torch.distributed.tensor import DTensor

    _validate.boolean(skip_empty, "from_dtensor(skip_empty)")
    if rename is not None and not isinstance(rename, Mapping):
        raise UsageError(f"from_dtensor(rename) takes a mapping name -> canonical name or None, got {rename!r:.80}")
    if isinstance(named_tensors, Mapping):
        items = list(named_tensors.items())
    elif isinstance(named_tensors, Iterable) and not isinstance(named_tensors, (str, bytes)):
        items = list(named_tensors)
    else:
        got = f"{named_tensors!r:.80}"
        raise UsageError(f"from_dtensor(named_tensors) takes a state dict or (name, tensor) pairs, got {got}")
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise UsageError(f"from_dtensor(named_tensors): each item must be a (name, tensor) pair, got {item!r:.80}")
    rename = dict(rename or {})
    out: dict[str, Entry] = {}
    for name, t in items:
        canon = rename.get(name, name)
        if isinstance(t, torch.nn.Parameter):
            t = t.data
        if isinstance(t, DTensor):
            local = t.to_local()
            if isinstance(local, torch.nn.Parameter):
                local = local.data
            if not local.is_contiguous():
                raise LayoutError(f"{name}: the local shard is not contiguous (strides {local.stride()})")
            if skip_empty and local.numel() == 0:
                continue
            decl = _dtensor_decl(canon, t, tuple(local.shape))
        elif isinstance(t, torch.Tensor):
            if not t.is_contiguous():
                raise LayoutError(f"{name}: tensor is not contiguous (strides {t.stride()})")
            local, decl = t, Shard(canon, tuple(t.shape))
        else:
            raise LayoutError(f"{name}: expected a DTensor or tensor, got {type(t).__name__}")
        out[name] = (local, decl)
    return out


def from_module(
    module: Any, *, prefix: str = "", rename: Mapping[str, str] | None = None, include_buffers: bool = False
) -> dict[str, Entry]:
    """A module whose parameter names are canonical names, unsharded (TP=1, no fusion).

    This is how a Hugging Face transformers model is registered as a trainer or as a rollout
    worker. Tied parameters are registered once (under their first name). DTensor parameters are
    delegated to ``from_dtensor``.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"from_module(module) takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(prefix, str):
        raise UsageError(f"from_module(prefix) must be a string, got {prefix!r:.80}")
    _validate.boolean(include_buffers, "from_module(include_buffers)")
    seen: set[int] = set()
    named = list(module.named_parameters(prefix=prefix, remove_duplicate=False))
    if include_buffers:
        named += list(module.named_buffers(prefix=prefix, remove_duplicate=False))
    picked = []
    for name, p in named:
        key = id(p)
        if key in seen:
            continue
        seen.add(key)
        picked.append((name, p))
    return from_dtensor(picked, rename=rename, skip_empty=False)
