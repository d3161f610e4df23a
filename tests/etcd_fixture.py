"""A throwaway single-member etcd for tests: loopback (or a test network namespace), temp data dir.

``EtcdServer(tmpdir).start()`` runs ``/usr/bin/etcd`` (Debian's ``etcd-server``) and waits until it
answers; ``stop()``/``kill()``/``restart()`` let fault tests take it down mid-use. The pytest fixture
``etcd_server`` (session scope) yields a running one and stops it afterwards; it skips with a clear
message only when no etcd binary is installed. Import it into a conftest to use it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence

import pytest

from transports._util import free_port  # noqa: F401 (re-exported for callers)

INSTALL_HINT = "apt-get install -y etcd-server"


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (os.path.exists("/usr/bin/etcd") and "/usr/bin/etcd") or None


class EtcdServer:
    """One etcd process. ``prefix_cmd`` runs it elsewhere, e.g. ``["ip", "netns", "exec", NAME]``."""

    def __init__(
        self,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        prefix_cmd: Sequence[str] = (),
        start_timeout: float = 30.0,
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError(f"no etcd binary; install it with: {INSTALL_HINT}")
        self.binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="wbridge-etcd-")
        self.host = host
        # Inside a namespace we cannot probe ports from here; the namespace is fresh, so any works.
        self.port = port or (free_port(host) if not prefix_cmd else 23790)
        self.peer_port = free_port(host) if not prefix_cmd else self.port + 1
        self.prefix_cmd = list(prefix_cmd)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    @property
    def http(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _argv(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return self.prefix_cmd + [
            self.binary,
            "--name",
            "wbtest",
            "--data-dir",
            os.path.join(self.data_dir, "data"),
            "--listen-client-urls",
            self.http,
            "--advertise-client-urls",
            self.http,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"wbtest={peer}",
            "--logger",
            "zap",
            "--log-level",
            "warn",
        ]

    def start(self) -> EtcdServer:
        if self.running:
            return self
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self._argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"etcd did not answer on {self.http} within {self.start_timeout}s: {self.log_tail()}")

    def healthy(self) -> bool:
        if self.prefix_cmd:
            code = (
                "import json,sys,urllib.request as u;"
                f"sys.exit(0 if json.load(u.urlopen('{self.http}/health',timeout=1))['health']=='true' else 1)"
            )
            argv = self.prefix_cmd + [sys.executable, "-c", code]
            return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0
        try:
            with urllib.request.urlopen(f"{self.http}/health", timeout=1) as r:
                return json.load(r).get("health") == "true"
        except (OSError, ValueError):
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal(self, sig: int, wait: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self._signal(signal.SIGTERM, 10)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, 10)

    def restart(self, down_for: float = 0.0) -> None:
        """Kills etcd (as a crash would), stays down ``down_for`` seconds, starts it on the same data."""
        self.kill()
        if down_for:
            time.sleep(down_for)
        self.start()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdServer({self.url!r}, running={self.running})"


@pytest.fixture(scope="session")
def etcd_server():
    """A running loopback etcd for the whole session; skips only if etcd is not installed."""
    if etcd_binary() is None:
        pytest.skip(f"etcd is not installed (Debian: {INSTALL_HINT})")
    server = EtcdServer()
    try:
        server.start()
        yield server
    finally:
        server.close()
