"""Which transport a subscriber uses to read from one publisher rank, and why.

The policy itself lives in ``transports.select`` (pure, shared with the transport tests); this
adapter feeds it the capabilities each publisher rank advertises in its signed record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transports import select as _select

RDMA_FIRST = _select.RDMA_FIRST


def rdma_present() -> bool:
    return bool(_select.rdma_devices())


def publisher_capabilities(served: Sequence[str]) -> dict[str, Any]:
    """What a publisher rank advertises: the transports it serves; nccl only when served."""
    return _select.capabilities(nccl="nccl" in served, transports=list(served))


def candidates(preference: str, local: Mapping[str, Any], remote: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Transports to try for one publisher rank, best first, each with its reason."""
    return _select.candidates(local, remote, preference)


__all__ = ["RDMA_FIRST", "candidates", "publisher_capabilities", "rdma_present"]
