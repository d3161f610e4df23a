"""Data movers. Import a transport by name with ``get(name)``; optional ones load lazily."""

from __future__ import annotations

import importlib

from .base import ReadBatch, Region, Transport
from .errors import AuthError, MissingExtraError, TransportError

#: name -> (module, class, pip extra that provides its dependency or None)
REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "tcp": ("transports.tcp", "TcpTransport", None),
    "local": ("transports.local", "LocalTransport", None),
    "mooncake": ("transports.mooncake", "MooncakeTransport", "mooncake"),
    "nixl": ("transports.nixl", "NixlTransport", "nixl"),
    "nccl": ("transports.nccl", "NcclTransport", None),
}


def get(name: str) -> type[Transport]:
    """The transport class called ``name``; ``MissingExtraError`` names the extra to install."""
    try:
        module, cls, extra = REGISTRY[name]
    except KeyError:
        raise TransportError(f"unknown transport {name!r}; known: {sorted(REGISTRY)}") from None
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        hint = f"pip install 'wbridge[{extra}]'" if extra else "a missing dependency"
        raise MissingExtraError(f"transport {name!r} is unavailable ({e}); install it with {hint}") from e
    return getattr(mod, cls)


def available() -> list[str]:
    """Names of the transports whose dependencies import here."""
    out = []
    for name in REGISTRY:
        try:
            cls = get(name)
        except TransportError:
            continue
        if getattr(cls, "usable", lambda: True)():
            out.append(name)
    return out


__all__ = [
    "AuthError",
    "MissingExtraError",
    "ReadBatch",
    "Region",
    "Transport",
    "TransportError",
    "available",
    "get",
    "REGISTRY",
]
