"""Fixtures for the store conformance suite: every test runs against ``tcp://`` and ``etcd://``."""

from __future__ import annotations

import uuid

import pytest

from tests.etcd_fixture import etcd_server  # noqa: F401 - re-exported fixture
from wbridge.store import Store, TcpStore, open_store


class StoreEnv:
    """One store under test: ``url`` for clients (other processes), ``open()`` for this one."""

    def __init__(self, kind: str, url: str, host: Store | None = None) -> None:
        self.kind, self.url, self._host = kind, url, host
        self._opened: list[Store] = []

    def open(self, **kw) -> Store:
        store = open_store(self.url, **kw)
        self._opened.append(store)
        return store

    def close(self) -> None:
        for s in self._opened:
            s.close()
        if self._host is not None:
            self._host.close()

    def __repr__(self) -> str:
        return f"StoreEnv({self.kind}, {self.url})"


@pytest.fixture(params=["tcp", "etcd"])
def store_env(request):
    if request.param == "tcp":
        host = TcpStore("127.0.0.1", 0, is_host=True, connect_timeout=10)
        env = StoreEnv("tcp", host.url, host)
    else:
        server = request.getfixturevalue("etcd_server")
        # A fresh key prefix per test keeps tests apart on the shared etcd.
        env = StoreEnv("etcd", f"{server.url}/t-{uuid.uuid4().hex[:12]}/")
    try:
        yield env
    finally:
        env.close()
