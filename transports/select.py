"""Transport choice: which transport a reader uses for one peer, and why (pure policy, no I/O in it).

Each side describes itself with ``capabilities()`` (a small JSON-able dict that can travel through
the store next to the endpoints; a reader may narrow its ``transports`` to those that reach the
memory its reads land in, named by an optional ``memory`` key); ``choose_transport(local,
remote)`` applies the ``auto`` order:

1. ``nixl``, then ``mooncake``: RDMA devices on both sides and the transport installed on both;
2. ``local``: both processes on the same host identity (same boot and pid namespace);
3. ``nccl``: both sides opted in to the two-sided fallback;
4. ``tcp``: everywhere else.

A named preference skips the order but is still checked: a transport whose extra is missing here
raises ``MissingExtraError`` naming the extra; one the peer lacks raises ``TransportError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import REGISTRY, _host, available, get
from ._host import rdma_devices
from .errors import TransportError

#: Order tried by ``auto`` among the one-sided RDMA engines.
RDMA_FIRST = ("nixl", "mooncake")

#: Keys of a capabilities dict (see ``capabilities``).
CAPABILITY_KEYS = ("transports", "rdma", "cuda", "host", "nccl")


def host_identity() -> str:
    """``<boot id>/<pid namespace inode>``: equal for two processes iff they can address each other's pids."""
    boot, pidns = _host.host_identity()
    return f"{boot}/{pidns}"


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def capabilities(*, nccl: bool = False, transports: list[str] | None = None) -> dict[str, Any]:
    """What this process offers: installed transports, RDMA devices, CUDA, host identity, nccl opt-in.

    ``nccl`` is the user's opt-in to the two-sided fallback (it joins process groups with peers);
    ``transports`` overrides the detected list (``transports.available()``).
    """
    names = list(available() if transports is None else transports)
    return {
        "transports": names,
        "rdma": rdma_devices(),
        "cuda": _cuda(),
        "host": host_identity(),
        "nccl": bool(nccl) and "nccl" in names,
    }


def _check_caps(side: str, caps: Mapping[str, Any]) -> None:
    if not isinstance(caps, Mapping):
        raise TransportError(f"{side} capabilities must be a mapping, got {type(caps).__name__}")
    missing = [k for k in CAPABILITY_KEYS if k not in caps]
    if missing:
        raise TransportError(f"{side} capabilities lack {missing}")
    if not isinstance(caps["transports"], (list, tuple)):
        raise TransportError(f"{side} capabilities: 'transports' must be a list")


def candidates(
    local_caps: Mapping[str, Any], remote_caps: Mapping[str, Any], preference: str = "auto"
) -> list[tuple[str, str]]:
    """Every usable transport for reading from the peer described by ``remote_caps``, best first, each
    with its reason (the ``auto`` order; a named ``preference`` is the only candidate).

    Raises ``MissingExtraError`` (naming the extra) when a named transport's dependency is missing
    here, ``TransportError`` when the peer lacks it or when the two sides share no transport at all.
    """
    _check_caps("local", local_caps)
    _check_caps("remote", remote_caps)
    here, there = set(local_caps["transports"]), set(remote_caps["transports"])
    if preference != "auto":
        if preference not in REGISTRY:
            raise TransportError(f"unknown transport {preference!r}; known: auto, {', '.join(sorted(REGISTRY))}")
        if preference not in here:
            get(preference)  # raises MissingExtraError naming the extra where the import fails
            raise TransportError(f"transport {preference!r} is installed but not usable in this process")
        if preference not in there:
            raise TransportError(f"transport {preference!r} requested but the peer offers only {sorted(there)}")
        return [(preference, "requested")]
    both = here & there
    rdma = bool(local_caps["rdma"] and remote_caps["rdma"])
    out = []
    if rdma:
        out += [
            (name, f"RDMA devices on both sides ({', '.join(local_caps['rdma'])} here); {name} on both")
            for name in RDMA_FIRST
            if name in both
        ]
    same_host = bool(local_caps["host"]) and local_caps["host"] == remote_caps["host"]
    if "local" in both and same_host:
        out.append(("local", "same host"))
    if "nccl" in both and local_caps["nccl"] and remote_caps["nccl"]:
        out.append(("nccl", "no one-sided path; both sides opted in to nccl"))
    if "tcp" in both:
        rdma_note = "RDMA on both sides but no common RDMA transport" if rdma else "no RDMA on both sides"
        out.append(
            ("tcp", f"same host but local unavailable, {rdma_note}" if same_host else f"different hosts, {rdma_note}")
        )
    if not out:
        # a reader whose buffers live in device memory lists only the transports that reach it
        memory = f" reaching its {local_caps['memory']} memory" if local_caps.get("memory") else ""
        raise TransportError(f"no common transport: this process has {sorted(here)}{memory}, the peer {sorted(there)}")
    return out


def choose_transport(
    local_caps: Mapping[str, Any], remote_caps: Mapping[str, Any], preference: str = "auto"
) -> tuple[str, str]:
    """``(name, reason)``: the first of ``candidates`` (same arguments, same errors)."""
    return candidates(local_caps, remote_caps, preference)[0]


__all__ = [
    "CAPABILITY_KEYS",
    "RDMA_FIRST",
    "candidates",
    "capabilities",
    "choose_transport",
    "host_identity",
    "rdma_devices",
]
