"""A publisher's staging: its slots, their stamps, and the snapshot copy that fills a slot with a
version (plain, cast to the published dtype, or packed for the readers' layouts)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.layout import Declaration, RankLayout

from ._packing import SlotPacker, copy_packed
from ._tensors import alloc_bytes, byte_view, describe
from .protocol import checksum as _checksum


@dataclass
class Registration:
    """What one ``Publisher.register()`` holds: the layout, the live tensors, the staging slots with
    their stamps and copy views, and the regions served for them."""

    layout: RankLayout
    tensors: dict[str, Any]
    decls: Mapping[str, tuple[Any, Declaration]]  # what register() was given (to register again)
    slots: list[Any]  # staging buffers (torch uint8), or live tensors (zero copy)
    regions: dict[str, list[list[Any]]] = field(default_factory=dict)  # transport -> slot -> regions
    copies: list[list[tuple[Any, Any]]] = field(default_factory=list)  # slot -> (dst, src) views
    stamps: list[Any] = field(default_factory=list)  # slot -> stamp buffer
    epoch: int = 0
    device: str = "cpu"
    zero_copy: bool = False
    copy_stream: Any = None  # CUDA: the snapshot copy's own stream
    packer: SlotPacker | None = None  # staged: slot layouts packed for the live readers
    cast: str | None = None  # the dtype register(dtype=) publishes floating tensors in
    transforms: dict[str, str] = field(default_factory=dict)  # register(transforms=): name -> transform


def staging_buffer(transports: Mapping[str, Any], size: int, device: str) -> Any:
    """A zeroed ``torch.uint8`` staging buffer: host memory a served transport serves best where
    one offers it (shared memory, say), else plain memory on ``device``."""
    buf = None
    if device == "cpu" and size:
        import torch

        for t in transports.values():
            host = t.host_buffer(size)
            if host is not None:
                buf = torch.frombuffer(host, dtype=torch.uint8, count=size)
                break
    if buf is None:
        buf = alloc_bytes(size, device)
    buf.zero_()  # fault the pages in now, not inside the first publish() stall
    return buf


def snapshot(reg: Registration, slot: int, ready: Any, packed: Any, checksums: bool) -> list | None:
    """Copies the live tensors into ``slot``; returns its checksums (None: not enabled). On
    CUDA the copy waits for ``ready`` (the caller's writes) on its own stream, and returns only
    when the bytes have landed: the stamp is about to say "stable"."""
    if reg.device != "cpu":
        import torch

        with torch.cuda.stream(reg.copy_stream):
            if ready is not None:
                reg.copy_stream.wait_event(ready)
            if packed is not None:
                copy_packed(packed, list(reg.tensors.values()), reg.slots[slot][0])
            for dst, src in [] if reg.zero_copy or packed is not None else reg.copies[slot]:
                dst.copy_(src, non_blocking=True)
        reg.copy_stream.synchronize()
    elif packed is not None:  # reader-ordered: one strided copy per cell (wbridge._packing)
        copy_packed(packed, list(reg.tensors.values()), reg.slots[slot][0])
    elif not reg.zero_copy:
        for dst, src in reg.copies[slot]:
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src)  # a plain memcpy (releases the GIL); torch's uint8 copy_ is slower here
            else:
                dst.copy_(src)  # a cast or transform (register(dtype=, transforms=)): vectorised per tensor
    if not checksums:
        return None
    return _checksum.chunk_sums(reg.slots[0] if reg.zero_copy else reg.slots[slot])


def copy_pairs(
    buf: Any, live: Mapping[str, Any], layout: RankLayout, device: str, transforms: Mapping[str, str]
) -> list[tuple[Any, Any]]:
    """(staging target, live tensor) pairs for the snapshot copy, built once per registration: raw
    bytes where the published dtype is the live one, typed torch views where the copy casts, and a
    quantising target (``wbridge._transforms``) for a transformed tensor."""
    import torch

    from ._transforms import SCALE_SUFFIX, Fp8Block128

    by_name = {lt.name: lt for lt in layout.tensors}

    def typed(lt: Any, shape: Any) -> Any:
        return buf[lt.offset : lt.offset + lt.nbytes].view(getattr(torch, lt.dtype)).view(shape)

    pairs = []
    for name, t in live.items():
        lt = by_name[name]
        if describe(name, t)[1] != lt.dtype:
            src = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            if name in transforms:  # fp8_block128, the one transform: the weight, then its scales
                scale = by_name[name + SCALE_SUFFIX]
                dst = Fp8Block128(typed(lt, src.shape), typed(scale, scale.shape))
            else:
                dst = typed(lt, src.shape)
            pairs.append((dst, src))
            continue
        dst, src = buf[lt.offset : lt.offset + lt.nbytes], byte_view(t)
        pairs.append((dst.numpy(), src.numpy()) if device == "cpu" else (dst, src))
    return pairs


def casts(layout: RankLayout, live: Mapping[str, Any]) -> bool:
    """Whether any live tensor is published in another dtype than its own (``register(dtype=)``,
    ``register(transforms=)``)."""
    by_name = {lt.name: lt for lt in layout.tensors}
    return any(describe(name, t)[1] != by_name[name].dtype for name, t in live.items())
