"""A publisher's staging: its slots, their stamps, and the snapshot copy that fills a slot with a
version (plain, cast to the published dtype, or packed for the readers' layouts).

Host staging: where the tensors live on a GPU and a served transport reaches host memory only
(``wbridge._selection.publisher_placement``), the slots are pinned host memory and the snapshot
runs on the device into one device buffer (``Registration.bounce``: the casts, the FP8 transform
and the packed copy are computed there), which is then copied to the host slot in one copy."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.layout import Declaration, RankLayout

from .._lifecycle import quietly
from .._selection import publisher_capabilities
from .._tensors import address, alloc_bytes, byte_view, describe
from ..protocol.records import b64
from ..protocol.stamps import STAMP_BYTES, STAMP_MAGIC, STAMP_WRITING
from .delta import release_ring
from .packing import PackedCopy, SlotPacker


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
    device: str = "cpu"  # where the live tensors are
    slot_device: str = "cpu"  # where the slots are: ``device``, or "cpu" (host staging)
    served: tuple[str, ...] = ()  # the transports that serve the slots
    bounce: Any = None  # host staging: the device buffer each snapshot is computed in
    zero_copy: bool = False
    copy_stream: Any = None  # CUDA: the snapshot copy's own stream
    packer: SlotPacker | None = None  # staged: slot layouts packed for the live readers
    packed_copies: dict[int, PackedCopy] = field(default_factory=dict)  # slot -> its last packed copy
    cast: str | None = None  # the dtype register(dtype=) publishes floating tensors in
    meta: dict | None = None  # register(metadata=): the channel metadata in this rank's record
    transforms: dict[str, str] = field(default_factory=dict)  # register(transforms=): name -> transform
    delta: Any = None  # Publisher(delta=True): the ring of delta buffers (wbridge.publish.delta)
    # this registration's incarnation, drawn afresh for each (``protocol.version.RankPart``)
    inc: str = field(default_factory=lambda: os.urandom(8).hex())
    layout_hashes: dict[int, str] = field(default_factory=dict)  # packing generation -> slot layout hash


def staging_buffer(transports: Mapping[str, Any], size: int, device: str, pinned: bool = False) -> Any:
    """A zeroed ``torch.uint8`` staging buffer: host memory a served transport serves best where
    one offers it (shared memory, say), else plain memory on ``device``; ``pinned``: page-locked
    host memory (host staging: the device's copies into it run asynchronously)."""
    buf = None
    if device == "cpu" and size and not pinned:
        import torch

        for t in transports.values():
            host = t.host_buffer(size)
            if host is not None:
                buf = torch.frombuffer(host, dtype=torch.uint8, count=size)
                break
    if buf is None:
        buf = alloc_bytes(size, device, pinned)
    buf.zero_()  # fault the pages in now, not inside the first publish() stall
    return buf


def writes_end(device: str) -> Any:
    """Where the caller's writes to the live tensors end, for ``snapshot`` to wait on: a CUDA event
    recorded on the caller's current stream of ``device``; None on the host."""
    if device == "cpu":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def snapshot(reg: Registration, slot: int, ready: Any, packed: Any) -> None:
    """Copies the live tensors into ``slot`` (nothing for zero copy). On CUDA the copy waits for
    ``ready`` (the caller's writes: ``writes_end``) on its own stream, and returns only when the bytes have landed:
    the stamp is about to say "stable"."""
    if reg.device != "cpu":
        import torch

        with torch.cuda.stream(reg.copy_stream):
            if ready is not None:
                reg.copy_stream.wait_event(ready)
            if packed is not None:
                packed_copy(reg, slot, packed).run()
            for dst, src in [] if reg.zero_copy or packed is not None else reg.copies[slot]:
                dst.copy_(src, non_blocking=True)
            if reg.bounce is not None:  # host staging: the computed slot, to the host in one copy
                reg.slots[slot][0].copy_(reg.bounce, non_blocking=True)
        reg.copy_stream.synchronize()
    elif packed is not None:  # reader-ordered: one copy per cell (wbridge.publish.packing)
        packed_copy(reg, slot, packed).run()
    elif not reg.zero_copy:
        for dst, src in reg.copies[slot]:
            if isinstance(dst, np.ndarray):
                np.copyto(dst, src)  # a plain memcpy (releases the GIL); torch's uint8 copy_ is slower here
            else:
                dst.copy_(src)  # a cast or transform (register(dtype=, transforms=)): vectorised per tensor


def packed_copy(reg: Registration, slot: int, packed: Any) -> PackedCopy:
    """``slot``'s copy program for the packing ``packed``, made when the packing changes (into the
    device buffer where the registration stages in host memory)."""
    pc = reg.packed_copies.get(slot)
    if pc is None or pc.ps is not packed:
        target = reg.slots[slot][0] if reg.bounce is None else reg.bounce
        pc = reg.packed_copies[slot] = PackedCopy(packed, list(reg.tensors.values()), target)
    return pc


def copy_pairs(
    buf: Any, live: Mapping[str, Any], layout: RankLayout, device: str, transforms: Mapping[str, str]
) -> list[tuple[Any, Any]]:
    """(staging target, live tensor) pairs for the snapshot copy, built once per registration: raw
    bytes where the published dtype is the live one, typed torch views where the copy casts, and a
    quantising target (``wbridge.publish.transforms``) for a transformed tensor."""
    import torch

    from .transforms import SCALE_SUFFIX, Fp8Block128

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


def build_registration(
    transports: Mapping[str, Any],
    layout: RankLayout,
    live: dict,
    decls: Mapping,
    device: str,
    old: Registration | None,
    transforms: dict,
    nslots: int,
    zero_copy: bool,
    slot_device: str,
) -> Registration:
    """The staging slots (or live views) of a registration on ``slot_device`` (the tensors'
    ``device``, or ``"cpu"``: host staging), registered with every transport of ``transports`` (those
    that serve them); ``old``'s buffers and stamps are reused where they fit (no new shared memory
    per call)."""
    host_staged = slot_device != device
    bounce = None
    if zero_copy:
        slots = [[byte_view(t) for t in live.values()]]
    else:
        size = layout.region_sizes[0] if layout.region_sizes else 0
        same = old is not None and (old.device, old.slot_device) == (device, slot_device) and not old.zero_copy
        if same and all(int(s[0].numel()) == size for s in old.slots) and len(old.slots) == nslots:
            slots, bounce = old.slots, old.bounce
        else:
            slots = [[staging_buffer(transports, size, slot_device, pinned=host_staged)] for _ in range(nslots)]
            bounce = alloc_bytes(size, device) if host_staged else None
    reg = Registration(layout, live, decls, slots, device=device, zero_copy=zero_copy, transforms=transforms)
    reg.slot_device, reg.served, reg.bounce = slot_device, tuple(transports), bounce
    if device != "cpu":
        import torch

        reg.copy_stream = torch.cuda.Stream(device=device)
    if bounce is not None:  # every slot's snapshot is computed in the one device buffer
        reg.copies = [copy_pairs(bounce, live, layout, device, transforms)] * len(slots)
    elif not zero_copy:
        reg.copies = [copy_pairs(slot[0], live, layout, device, transforms) for slot in slots]
    # Each slot's last region is its stamp: the version it holds and whether it is being
    # written. Readers check it after their reads (a seqlock in the data plane), so a store
    # that lies about fences cannot make them commit a slot that changed under them.
    if old is not None and len(old.stamps) == len(slots):
        reg.stamps = old.stamps  # their content stays right: each snapshot rewrites its stamp
    else:
        reg.stamps = [staging_buffer(transports, STAMP_BYTES, "cpu") for _ in slots]
        for stamp in reg.stamps:
            stamp.numpy().view(np.uint64)[:] = (STAMP_MAGIC, 0, STAMP_WRITING, 0)
    try:
        for name, t in transports.items():
            reg.regions[name] = per_slot = []
            for slot, stamp in zip(slots, reg.stamps):
                regions: list[Any] = []
                per_slot.append(regions)
                for buf in slot:
                    regions.append(t.register(address(buf), int(buf.numel()), device=slot_device))
                regions.append(t.register(address(stamp), STAMP_BYTES, device="cpu"))
    except BaseException:
        release_regions(reg, transports)
        raise
    return reg


def release_regions(reg: Registration, transports: Mapping[str, Any]) -> None:
    """Stops serving ``reg``'s regions (its buffers may live on in a newer registration)."""
    release_ring(reg.delta, transports)
    regions, reg.regions = reg.regions, {}
    for name, per_slot in regions.items():
        for slot in per_slot:
            for r in slot:
                quietly(transports[name].deregister, r)


def served_record(reg: Registration, transports: Mapping[str, Any], rank: int, world_size: int, nslots: int) -> dict:
    """The publisher rank's store record: its layout, capabilities, and per served transport the
    endpoint and each slot's region descriptors (the stamp last), and the delta buffers' where
    the publisher encodes deltas."""
    record = {
        "rank": rank,
        "world_size": world_size,
        "epoch": reg.epoch,
        "inc": reg.inc,
        "layout": reg.layout.to_dict(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "caps": publisher_capabilities(list(transports)),
        "slots": nslots,
        "zero_copy": reg.zero_copy,
        "device": reg.device,
        "slot_device": reg.slot_device,
        "transports": {
            name: {
                "endpoint": b64(t.endpoint()),
                "regions": [[b64(r.descriptor) for r in slot] for slot in reg.regions[name]],
            }
            for name, t in transports.items()
        },
    }
    if reg.delta is not None:
        for name, served in record["transports"].items():
            served["delta"] = [b64(r.descriptor) for r in reg.delta.regions[name]]
    return record
