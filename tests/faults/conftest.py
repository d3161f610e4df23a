"""Fixtures for the fault tests: test hosts (network namespaces), etcd, a standalone store process."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.etcd_fixture import EtcdServer, etcd_binary, etcd_server  # noqa: F401 - re-exported fixture
from tests.hosts import ROOT, network  # noqa: F401 - re-exported fixture
from tests.runtime.harness import free_port


def standalone_store_proc(
    host: str = "127.0.0.1", timeout: float = 60.0, port: int | None = None
) -> tuple[subprocess.Popen, str]:
    """``wbridge store serve`` in its own process (on ``port``, default a free one); returns it
    and its URL once it serves."""
    port = free_port() if port is None else port
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "wbridge.cli", "store", "serve", "--host", host, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    out = b""
    deadline = time.monotonic() + timeout
    while b"serving" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"wbridge store serve did not start: {out.decode(errors='replace')}")
        if sel.select(left):
            out += proc.stdout.readline()
    sel.close()
    return proc, f"tcp://{host}:{port}"


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``: R, S, T...; "gone" if none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def freeze_group(pid: int, within: float = 10.0) -> None:
    """SIGSTOPs process group ``pid`` (a store hung: the kernel still accepts, nobody answers) and
    returns once its leader is stopped (state T): the calls a test makes next meet a hung store,
    not one still finishing its last request."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within
    while process_state(pid) != "T":
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop: state {process_state(pid)}")
        time.sleep(0.005)


@pytest.fixture
def standalone_store():
    """A TCP store served by ``wbridge store serve`` (outside every publisher); killed afterwards."""
    proc, url = standalone_store_proc()
    try:
        yield url
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


@pytest.fixture
def etcd_url(request):
    """A fresh key prefix on the session's loopback etcd."""
    server = request.getfixturevalue("etcd_server")
    return f"{server.url}/f-{uuid.uuid4().hex[:12]}/"


@pytest.fixture
def store_url(request):
    """``store_url`` parametrized indirectly: "cli" (``wbridge store serve``) or "etcd"."""
    kind = request.param
    if kind == "cli":
        return request.getfixturevalue("standalone_store")
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    return request.getfixturevalue("etcd_url")


__all__ = ["EtcdServer", "network", "etcd_server", "standalone_store_proc"]
