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


def choose_transport(preference: str, served: Mapping[str, object], same_host: bool) -> tuple[str, str]:
    """``(name, reason)``. ``auto`` is RDMA-first: nixl or mooncake where RDMA devices exist, then
    ``local`` on the same host, then ``nccl`` when the publisher serves it, then ``tcp``."""
    if preference != "auto":
        if preference not in served:
            raise TransportError(f"transport {preference!r} requested but the publisher serves only "
                                 f"{sorted(served)}")
        try:
            _transports.get(preference)
        except _transports.MissingExtraError as e:
            raise MissingExtraError(str(e)) from e
        return preference, "requested"
    here = set(_transports.available())
    if rdma_present():
        for name in RDMA_FIRST:
            if name in served and name in here:
                return name, "RDMA devices present"
    if same_host and "local" in served and "local" in here:
        return "local", "publisher on the same host"
    if "nccl" in served and "nccl" in here:
        return "nccl", "no one-sided path; both sides opted into nccl"
    if "tcp" in served and "tcp" in here:
        return "tcp", "different host" if not same_host else "local transport unavailable"
    raise TransportError(f"no common transport: the publisher serves {sorted(served)}, "
                         f"this process has {sorted(here)}")
