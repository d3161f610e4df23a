"""Which transport a subscriber uses to read from one publisher rank, and why."""
from __future__ import annotations

import os
from typing import Mapping

import transports as _transports

from .errors import MissingExtraError, TransportError

RDMA_FIRST = ("nixl", "mooncake")


def rdma_present() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def candidates(preference: str, served: Mapping[str, object], same_host: bool) -> list[tuple[str, str]]:
    """Transports to try, best first, each with the reason it was chosen. ``auto`` is RDMA-first:
    nixl or mooncake where RDMA devices exist, then ``local`` on the same host, then ``nccl`` when
    the publisher serves it, then ``tcp``. A named transport is the only candidate."""
    if preference != "auto":
        if preference not in served:
            raise TransportError(f"transport {preference!r} requested but the publisher serves only "
                                 f"{sorted(served)}")
        try:
            _transports.get(preference)
        except _transports.MissingExtraError as e:
            raise MissingExtraError(str(e)) from e
        return [(preference, "requested")]
    here = set(_transports.available())
    out = []
    if rdma_present():
        out += [(n, "RDMA devices present") for n in RDMA_FIRST if n in served and n in here]
    if same_host and "local" in served and "local" in here:
        out.append(("local", "publisher on the same host"))
    if "nccl" in served and "nccl" in here:
        out.append(("nccl", "no one-sided path; both sides opted into nccl"))
    if "tcp" in served and "tcp" in here:
        out.append(("tcp", "different host" if not same_host else "fallback"))
    if not out:
        raise TransportError(f"no common transport: the publisher serves {sorted(served)}, "
                             f"this process has {sorted(here)}")
    return out


def choose_transport(preference: str, served: Mapping[str, object], same_host: bool) -> tuple[str, str]:
    """The first of ``candidates``."""
    return candidates(preference, served, same_host)[0]
