"""The metadata store: a small key-value service shared by publishers and subscribers.

``open_store(url, ...)`` returns a ``Store`` (see ``base`` for the call protocol). ``tcp://host:port``
is torch's TCPStore (``tcp``, the embedded default, hosted by one publisher);
``etcd://host:port[,host:port]`` is etcd v3 for clusters (``etcd``).
"""

from __future__ import annotations

from urllib.parse import urlparse

from .. import _validate
from ..errors import StoreError, UsageError
from .base import DEFAULT_CONNECT_TIMEOUT, Lease, Store
from .tcp import TcpStore

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "Lease", "Store", "TcpStore", "check_url", "open_store"]


def check_url(url: object, *, host_store: bool = False) -> str:
    """A store URL checked without connecting: ``tcp://host:port`` or ``etcd://host:port[,...][/prefix]``,
    ports in 0..65535, and, where this process hosts the store (``host_store``), a host that is not a
    wildcard (``tcp://0.0.0.0:P`` would listen on every interface). ``UsageError`` names the URL."""
    if not isinstance(url, str):
        raise UsageError(f"store must be a url (tcp://host:port, etcd://host:port) or a Store, got {url!r:.80}")
    _validate.boolean(host_store, "host_store")
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        try:
            port = parsed.port
        except ValueError:
            port = None
        if not parsed.hostname or port is None:
            raise UsageError(f"store url {url!r:.200} needs tcp://host:port")
        if host_store:
            _validate.host(parsed.hostname, f"store url {url!r:.200} (hosted here)")
        return url
    if parsed.scheme == "etcd":
        if host_store:
            raise UsageError("an etcd store is run by etcd itself; host_store=True applies to tcp:// only")
        from .etcd import parse_url

        try:
            parse_url(url)
        except StoreError as e:
            raise UsageError(str(e)) from None
        return url
    raise UsageError(f"unknown store url {url!r:.200}; use tcp://host:port or etcd://host:port")


def open_store(url: str, *, host_store: bool = False, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Store:
    """Opens (or, with ``host_store=True``, hosts) the store at ``url`` (checked by ``check_url``
    before anything is opened)."""
    if isinstance(url, Store):
        return url
    check_url(url, host_store=host_store)
    connect_timeout = _validate.timeout(connect_timeout, "connect_timeout", positive=True)
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        return TcpStore(parsed.hostname, parsed.port, is_host=host_store, connect_timeout=connect_timeout)
    from .etcd import EtcdStore

    return EtcdStore(url, connect_timeout=connect_timeout)
