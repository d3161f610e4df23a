"""The metadata store: a small key-value service shared by publishers and subscribers.

``open_store(url, ...)`` returns a ``Store`` (see ``base`` for the call protocol). ``tcp://host:port``
is torch's TCPStore (``tcp``, the embedded default, hosted by one publisher);
``etcd://host:port[,host:port]`` is etcd v3 for clusters (``etcd``).
"""

from __future__ import annotations

from urllib.parse import urlparse

from .. import _validate
from ..errors import StoreError
from .base import DEFAULT_CONNECT_TIMEOUT, Lease, Store
from .tcp import TcpStore

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "Lease", "Store", "TcpStore", "open_store"]


def open_store(url: str, *, host_store: bool = False, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Store:
    """Opens (or, with ``host_store=True``, hosts) the store at ``url``."""
    if isinstance(url, Store):
        return url
    if not isinstance(url, str):
        raise StoreError(f"store must be a url (tcp://host:port, etcd://host:port) or a Store, got {url!r:.80}")
    connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme == "tcp":
        if not parsed.hostname or port is None:
            raise StoreError(f"store url {url!r} needs tcp://host:port")
        return TcpStore(parsed.hostname, parsed.port, is_host=host_store, connect_timeout=connect_timeout)
    if parsed.scheme == "etcd":
        if host_store:
            raise StoreError("an etcd store is run by etcd itself; host_store=True applies to tcp:// only")
        from .etcd import EtcdStore

        return EtcdStore(url, connect_timeout=connect_timeout)
    raise StoreError(f"unknown store url {url!r}; use tcp://host:port or etcd://host:port")
