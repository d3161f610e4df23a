"""Which transport a subscriber uses to read from one publisher rank, and why; and where staging
memory must live so that the transports used reach it (host staging).

The transport policy itself lives in ``transports.select`` (pure, shared with the transport
tests); this adapter feeds it the capabilities each publisher rank advertises in its signed record.

Host staging. Each transport declares the memory it reaches (``Transport.memory_kinds``: tcp,
local and mooncake ``("cpu",)``, nixl and nccl ``("cpu", "cuda")``). Where registered tensors live
in device memory that a transport in use cannot reach, the bytes go through host memory:

- a publisher's staging slots live in (pinned) host memory; its snapshot computes what it
  computes (casts, the FP8 transform, the packed copy) on the device and copies the result to the
  host slot (``publisher_placement``);
- a subscriber reads into a (pinned) host buffer and copies into its device tensors once every read
  succeeded, as a staged subscriber does (``subscriber_placement``), or, where it asked to read
  straight into device tensors through a transport that cannot reach them, ``UsageError``.

The two decisions are pure functions of device names and memory kinds, so they run (and are tested)
on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import transports as _transports
from transports import select as _select

from .errors import UsageError

RDMA_FIRST = _select.RDMA_FIRST


def rdma_present() -> bool:
    return bool(_select.rdma_devices())


def publisher_capabilities(served: Sequence[str]) -> dict[str, Any]:
    """What a publisher rank advertises: the transports it serves; nccl only when served."""
    return _select.capabilities(nccl="nccl" in served, transports=list(served))


def candidates(preference: str, local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Transports to try for one publisher rank, best first, each with its reason."""
    return _select.candidates(local, remote, preference)


# ------------------------------------------------------------------------------------------------
# Host staging


def memory_kind(device: str) -> str:
    """``"cpu"`` or ``"cuda"``: the kind of memory a device name (``cpu``, ``cuda:1``) stands for."""
    return "cuda" if device.startswith("cuda") else "cpu"


def memory_kinds(names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The memory kinds each installed transport of ``names`` reaches (``Transport.memory_kinds``);
    names whose transport does not import here are left out."""
    out = {}
    for name in names:
        try:
            out[name] = tuple(_transports.get(name).memory_kinds)
        except _transports.TransportError:
            continue
    return out


def reaching(kinds: Mapping[str, Sequence[str]], device: str) -> list[str]:
    """The transports of ``kinds`` (name -> memory kinds) that reach memory on ``device``."""
    kind = memory_kind(device)
    return [name for name, reach in kinds.items() if kind in reach]


@dataclass(frozen=True)
class SlotPlacement:
    """Where a publisher registration's served memory lives, and who serves it.

    - ``device``: the staging slots' device: the tensors' own, or ``"cpu"`` (host staging).
    - ``served``: the transports that serve them (a subset of those the publisher opened).
    """

    device: str
    served: tuple[str, ...]


def publisher_placement(
    device: str, kinds: Mapping[str, Sequence[str]], *, auto: bool, zero_copy: bool, who: str
) -> SlotPlacement:
    """Where the slots of tensors on ``device`` live, served by the transports ``kinds`` (name ->
    memory kinds, each transport the publisher opened).

    Host tensors, or device tensors that every transport reaches: slots on ``device``. With
    ``transport="auto"`` (``auto``), device tensors are served by the transports that reach them
    where any does (nixl where RDMA devices exist: GPUDirect reads), else from host slots. A named
    list with a transport that cannot reach ``device``: host slots for all of them. ``ZeroCopy``
    serves the live tensors themselves: a transport that cannot reach them is a ``UsageError``."""
    names = tuple(kinds)
    reach = tuple(reaching(kinds, device))
    if memory_kind(device) == "cpu" or reach == names:
        return SlotPlacement(device, names)
    if auto and reach:
        return SlotPlacement(device, reach)
    if zero_copy:
        host_only = [n for n in names if n not in reach]
        raise UsageError(
            f"{who}: staging=ZeroCopy() serves the live tensors on {device}, which {', '.join(host_only)} "
            f"cannot reach (host memory only): use staging=Staging() (slots in host memory) or serve a "
            f"transport that reaches device memory ({', '.join(_device_transports())})"
        )
    return SlotPlacement("cpu", names)


@dataclass(frozen=True)
class BufferPlacement:
    """Where a subscriber's reads land.

    - ``device``: the read buffers' device: the tensors' own, or ``"cpu"`` (host staging).
    - ``staged``: reads land in a private buffer, copied into the tensors after every read succeeded.
    """

    device: str
    staged: bool


def subscriber_placement(
    device: str,
    preference: str,
    staged: bool,
    kinds: Mapping[str, Sequence[str]],
    rdma: bool,
    who: str,
    serves: Sequence[str] = (),
) -> BufferPlacement:
    """Where the reads of a subscriber with tensors on ``device`` land. ``preference``: its
    ``transport=``; ``staged``: its ``staged=``; ``kinds``: the memory kinds of the transports
    installed here (``memory_kinds``); ``rdma``: RDMA devices here; ``serves``: the transports it
    also serves its buffer through (a relay's, ``wbridge.pull.zone``).

    Host tensors, or a transport that reaches ``device``: as asked. ``auto`` reads device memory
    where a one-sided RDMA transport that reaches it can be chosen (RDMA devices here and nixl
    installed), else through a pinned host buffer (staged). A named transport that cannot reach
    ``device``: staged through host memory, or ``UsageError`` where the subscriber asked to read
    straight into its tensors (``staged=False``). A buffer served through a transport that cannot
    reach ``device`` is in host memory (staged)."""
    if memory_kind(device) == "cpu":
        return BufferPlacement(device, staged)
    reach = reaching(kinds, device)
    if any(name in kinds and name not in reach for name in serves):
        return BufferPlacement("cpu", True)
    if preference == "auto":
        direct = rdma and any(name in reach for name in RDMA_FIRST)
        return BufferPlacement(device, staged) if direct else BufferPlacement("cpu", True)
    if preference in reach or preference not in kinds:  # (not installed: connecting says so)
        return BufferPlacement(device, staged)
    if staged:
        return BufferPlacement("cpu", True)
    raise UsageError(
        f"{who}: the tensors are on {device}, but transport {preference!r} reaches host memory only: "
        f"pass staged=True (reads land in pinned host memory, then one copy to {device}) or a transport "
        f"that reaches device memory ({', '.join(_device_transports())})"
    )


def _device_transports() -> list[str]:
    """The transports installed here that reach device memory (for messages)."""
    return reaching(memory_kinds(list(_transports.REGISTRY)), "cuda") or ["none installed here"]


__all__ = [
    "RDMA_FIRST",
    "BufferPlacement",
    "SlotPlacement",
    "candidates",
    "memory_kind",
    "memory_kinds",
    "publisher_capabilities",
    "publisher_placement",
    "rdma_present",
    "reaching",
    "subscriber_placement",
]
