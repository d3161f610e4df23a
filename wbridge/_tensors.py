"""Helpers to treat torch tensors and numpy arrays as raw memory."""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from typing import Any

import numpy as np

from planner.dtypes import ITEMSIZE

from .errors import LayoutError


def describe(name: str, t: Any) -> tuple[tuple[int, ...], str, str]:
    """``(shape, dtype name, device)`` of a contiguous tensor; ``LayoutError`` names it otherwise."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous:
            raise LayoutError(
                f"tensor {name!r} is not contiguous (numpy strides {t.strides}); register a contiguous array"
            )
        dtype = str(t.dtype)
        device = "cpu"
    else:
        try:
            import torch
        except ImportError:  # pragma: no cover
            raise LayoutError(f"tensor {name!r}: unsupported type {type(t).__name__}") from None
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"tensor {name!r}: expected a torch.Tensor or numpy array, got {type(t).__name__}")
        if not t.is_contiguous():
            raise LayoutError(
                f"tensor {name!r} is not contiguous (strides {tuple(t.stride())}); "
                "call .contiguous() or register the underlying storage"
            )
        dtype = str(t.dtype).removeprefix("torch.")
        device = str(t.device)
        if device != "cpu" and not device.startswith("cuda"):
            raise LayoutError(f"tensor {name!r} lives on {device}; only cpu and cuda are supported")
    if dtype not in ITEMSIZE:
        raise LayoutError(f"tensor {name!r} has unsupported dtype {dtype}")
    return tuple(int(s) for s in t.shape), dtype, device


def address(t: Any) -> int:
    if isinstance(t, np.ndarray):
        return int(t.ctypes.data)
    return int(t.data_ptr())


def nbytes(t: Any) -> int:
    if isinstance(t, np.ndarray):
        return int(t.nbytes)
    return int(t.numel() * t.element_size())


def byte_view(t: Any):
    """A flat ``torch.uint8`` view of a contiguous tensor or numpy array (no copy)."""
    import torch

    if isinstance(t, np.ndarray):
        return torch.from_numpy(t.reshape(-1).view(np.uint8))
    return t.reshape(-1).view(torch.uint8)


#: Host buffers of at least this many bytes are mapped with transparent huge pages (where the
#: kernel allows them: /sys/kernel/mm/transparent_hugepage/enabled says "madvise" or "always").
HUGE_PAGE_BYTES = 1 << 21


def alloc_bytes(n: int, device: str, pinned: bool = False):
    """A ``torch.uint8`` buffer of ``n`` bytes on ``device`` (page-aligned on the host); ``pinned``:
    page-locked host memory, which device copies reach asynchronously (needs CUDA: host staging).

    An unpinned host buffer of ``HUGE_PAGE_BYTES`` or more is a private anonymous mapping, rounded up
    to whole huge pages (the kernel then aligns it to one), that asks for transparent huge pages: a
    pass over a staging slot (the delta scan, a checksum) walks 2 MiB pages, not 4 KiB ones.
    torch's allocator asks for none: the delta encoder scanned two cold 9.6 MB slots in 2.50 ms
    out of torch's memory, 2.06 ms out of huge pages."""
    import torch

    if device == "cpu":
        if pinned or n < HUGE_PAGE_BYTES:
            return torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=pinned)
        size = -(-n // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (zeroed)
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # (no madvise on this platform, or no huge pages in its kernel)
            pass
        return torch.frombuffer(mm, dtype=torch.uint8, count=n)  # (the tensor keeps ``mm`` alive)
    return torch.empty(max(n, 1), dtype=torch.uint8, device=device)


#: Dtypes a publisher may cast from and to at snapshot time (``Publisher.register(dtype=...)``).
FLOATING = ("float64", "float32", "float16", "bfloat16")


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16``, ``np.float32`` or ``"bfloat16"`` as the planner's dtype name."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def build_layout(rank: int, tensors: Any, *, pack: bool, who: str, cast: str | None = None, transforms: Any = None):
    """``(layout, live tensors by name, device)`` of ``{name: (tensor, declaration)}``; the one
    place both sides turn registered tensors into a ``RankLayout``. ``cast``: the dtype that the
    floating tensors are laid out (published) in; other tensors keep theirs. ``transforms``:
    ``{name: transform}`` (``wbridge.publish.transforms``), laid out as the transform publishes them."""
    from planner.compiler import LayoutBuilder

    from .errors import UsageError
    from .publish.transforms import fp8_block128_layout

    builder = LayoutBuilder(rank, pack=pack)
    live: dict[str, Any] = {}
    devices = set()
    for name, entry in tensors.items():
        try:
            tensor, decl = entry
        except (TypeError, ValueError):
            raise UsageError(f"tensor {name!r}: expected (tensor, declaration)") from None
        shape, dtype, device = describe(name, tensor)
        if transforms and name in transforms:
            if dtype not in FLOATING:
                raise UsageError(f"{who}: tensor {name!r}: {transforms[name]} takes a floating tensor, not {dtype}")
            entries = fp8_block128_layout(name, shape, decl, who)
        else:
            entries = [(name, shape, cast if cast is not None and dtype in FLOATING else dtype, decl)]
        for entry in entries:
            builder.add(*entry)
        devices.add(device)
        live[name] = tensor
    layout = builder.build()
    if len(devices) > 1:
        raise UsageError(f"{who}: tensors on several devices {sorted(devices)}")
    return layout, live, devices.pop()


def commit_pairs(plan: Any, layout: Any, live: Mapping[str, Any], private: Any) -> list[tuple[Any, Any]]:
    """Staged mode: (live slice, private slice) views of every mapped byte range, built once per
    plan: numpy arrays where both are host memory (a memcpy), else torch views (a device copy; from
    a host private buffer to device tensors where the subscriber stages in host memory)."""
    if len(plan) == 0:
        return []
    offs = np.concatenate([s.dst_offset for s in plan.sources])
    lens = np.concatenate([s.nbytes for s in plan.sources])
    order = np.argsort(offs, kind="stable")
    offs, lens = offs[order], lens[order]
    ends = offs + lens
    # merge touching ranges
    starts_new = np.ones(len(offs), dtype=bool)
    starts_new[1:] = offs[1:] != ends[:-1]
    idx = np.flatnonzero(starts_new)
    m_off = offs[idx]
    m_end = np.maximum.reduceat(ends, idx)
    out = []
    tensors = sorted((lt.offset, lt.offset + lt.nbytes, lt.name) for lt in layout.tensors)
    bounds = np.array([t[0] for t in tensors])
    views = {name: byte_view(t) for name, t in live.items()}
    host = {name: v.device.type == "cpu" and private.device.type == "cpu" for name, v in views.items()}
    for a, b in zip(m_off.tolist(), m_end.tolist()):
        while a < b:
            k = int(np.searchsorted(bounds, a, side="right")) - 1
            lo, hi, name = tensors[k]
            n = min(b, hi) - a
            dst, src = views[name][a - lo : a - lo + n], private[a : a + n]
            out.append((dst.numpy(), src.numpy()) if host[name] else (dst, src))
            a += n
    return out
