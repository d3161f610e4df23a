"""What this host offers, read from /proc and /sys: its identity for pid addressing, and its RDMA devices."""

from __future__ import annotations

import os

INFINIBAND = "/sys/class/infiniband"


def read_text(path: str) -> str:
    """The stripped content of a small text file, or ``""`` where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity() -> tuple[str, int]:
    """(boot id, pid namespace inode): two processes can name each other's pids iff both match."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return read_text("/proc/sys/kernel/random/boot_id"), pidns


def rdma_devices(root: str = INFINIBAND) -> list[str]:
    """Names of the RDMA devices this machine exposes (``mlx5_0``, ...); empty where there are none."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def rdma_ports(root: str = INFINIBAND) -> list[str]:
    """``device:port`` for every port of every RDMA device (UCX's names for them)."""
    out = []
    for dev in rdma_devices(root):
        try:
            out += [f"{dev}:{port}" for port in sorted(os.listdir(os.path.join(root, dev, "ports")))]
        except OSError:
            continue
    return out
