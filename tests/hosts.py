"""Multi-host test harness: Linux network namespaces as hosts, joined through a bridge by veth pairs.

    with Network(2) as net:                  # or the ``network`` fixture: net = network(2)
        a, b = net.hosts                     # a.addr == "10.123.0.1", b.addr == "10.123.0.2"
        srv = a.python(SERVER_CODE)          # a Python process inside namespace a (a ``Proc``)
        cli = b.python(CLIENT_CODE)
        net.cut(b)                           # b's link down: packets to and from b are lost
        net.restore(b)
        net.shape(a, "400mbit")              # a's link shaped with tc tbf, both directions

Layout: one "switch" namespace holds a bridge; each host namespace has ``eth0`` (10.123.0.<i+1>/24)
whose veth peer is a bridge port in the switch. Cutting a host sets that bridge port down. Nothing is
created in the root namespace and nothing routes out, so traffic stays between our namespaces; the
addresses can repeat across concurrent test runs because every run has its own namespaces.

``Proc`` speaks JSON lines: ``send(obj)`` writes one to the process's stdin, ``recv(timeout)`` reads one
from its stdout (bounded). ``close()`` (also the fixture's finalizer, even on failure) kills every
process it started and deletes every namespace. Namespaces left by a crashed run (named
``<prefix><pid>-``, ``wbt`` unless a test names its own prefix; pid dead) are removed on the next
start. Tests skip with a clear message where namespaces cannot be made (not root, no iproute2, no
CAP_SYS_ADMIN).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.123.0"
_PREFIX = "wbt"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def netns_unavailable() -> str | None:
    """Why namespaces cannot be created here, or None when they can."""
    if shutil.which("ip") is None:
        return "no 'ip' command (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    try:
        out = _ip("netns", "add", probe, check=False)
        if out.returncode != 0:
            return f"cannot create a network namespace: {out.stderr.strip()}"
        out = _ip("-n", probe, "link", "add", "br0", "type", "bridge", check=False)
        if out.returncode != 0:
            return f"cannot create a bridge in a namespace: {out.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale(prefix: str = _PREFIX) -> None:
    """Deletes namespaces that an earlier run (now dead) of this harness left behind."""
    out = _ip("netns", "list", check=False)
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{prefix}(\d+)-", name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Proc:
    """A process in a namespace, with a JSON-lines channel on stdin/stdout; stderr goes to a file."""

    def __init__(self, host: Host, argv: Sequence[str], env: dict[str, str]) -> None:
        self.host = host
        self.argv = list(argv)
        self._err = open(os.path.join(host.net.workdir, f"{host.name}-{next(_counter)}.err"), "w+b")
        self.popen = subprocess.Popen(
            host.exec_prefix + self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
            start_new_session=True,
        )
        self._lines: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"hosts-read-{self.popen.pid}").start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: Any) -> None:
        self.popen.stdin.write(json.dumps(obj).encode() + b"\n")
        self.popen.stdin.flush()

    def recv(self, timeout: float) -> Any:
        """The next JSON line the process printed; RuntimeError if it exits or stays silent."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise RuntimeError(f"{self} said nothing for {timeout}s; stderr: {self.stderr()}") from None
            if line is None:
                self.popen.wait(5)
                raise RuntimeError(f"{self} exited with {self.popen.returncode}; stderr: {self.stderr()}")
            if line.startswith(b"{"):
                return json.loads(line)
            # Anything else on stdout (a library's chatter) is not part of the protocol.

    def request(self, obj: Any, timeout: float) -> Any:
        self.send(obj)
        return self.recv(timeout)

    def stderr(self, n: int = 3000) -> str:
        self._err.flush()
        self._err.seek(0)
        return self._err.read()[-n:].decode(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        self.kill()
        for f in (self.popen.stdin, self.popen.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._err.close()

    def __repr__(self) -> str:
        state = "running" if self.popen.poll() is None else f"exit={self.popen.returncode}"
        return f"Proc(pid={self.popen.pid} on {self.host.name}, {state})"


class Host:
    """One namespace: ``name``, ``addr`` on ``eth0``, and ways to run commands inside it."""

    def __init__(self, net: Network, index: int) -> None:
        self.net, self.index = net, index
        self.name = f"{net.tag}-h{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.port_name = f"p{index}"  # its bridge port in the switch namespace

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def run(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_prefix + list(argv), capture_output=True, text=True, timeout=timeout)

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(self, argv, env or self.net.env)
        self.net.procs.append(proc)
        return proc

    def python(self, code: str, *args: str) -> Proc:
        """Runs ``python -c code args...`` (this venv's interpreter, repo on PYTHONPATH) in the namespace."""
        return self.popen([sys.executable, "-u", "-c", code, *args])

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr})"


class Network:
    """``n`` hosts on one bridge. Context manager; ``close()`` is idempotent and removes everything.

    ``prefix`` starts every namespace's name (a test's own, so concurrent suites never share names).
    """

    def __init__(self, n: int, workdir: str | None = None, prefix: str = _PREFIX) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"a test network has 1..200 hosts, not {n}")
        if not re.fullmatch(r"[a-z]{1,5}", prefix):
            raise ValueError(f"a namespace prefix is 1 to 5 lowercase letters, not {prefix!r}")
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.tag}-sw"
        self.workdir = workdir or os.path.join("/tmp", self.tag)
        os.makedirs(self.workdir, exist_ok=True)
        self.env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.procs: list[Proc] = []
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._closed = False
        remove_stale(prefix)
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self, n: int) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(n):
            host = Host(self, i)
            self._add_ns(host.name)
            # Both ends are born in their namespaces: nothing touches the root namespace.
            _ip(
                "-n",
                self.switch,
                "link",
                "add",
                host.port_name,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.name,
            )
            _ip("-n", self.switch, "link", "set", host.port_name, "master", "br0")
            _ip("-n", self.switch, "link", "set", host.port_name, "up")
            _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.name, "link", "set", "eth0", "up")
            self.hosts.append(host)

    def host(self, h: Host | int) -> Host:
        return h if isinstance(h, Host) else self.hosts[h]

    def cut(self, h: Host | int) -> None:
        """Takes the host's link down: its packets are dropped (no reset is sent to anyone)."""
        _ip("-n", self.switch, "link", "set", self.host(h).port_name, "down")

    def restore(self, h: Host | int) -> None:
        _ip("-n", self.switch, "link", "set", self.host(h).port_name, "up")
        # Forget addresses that failed to resolve while cut, so the next packet resolves afresh
        # instead of failing with "no route to host" for a while.
        for host in self.hosts:
            _ip("-n", host.name, "neigh", "flush", "all", check=False)

    def shape(self, h: Host | int, rate: str, burst: str = "1mb", latency: str = "100ms") -> None:
        """Limits the host's link to ``rate`` (``tc ... tbf``, e.g. ``400mbit``) in both directions:
        on its ``eth0`` (what it sends) and on its bridge port (what it receives)."""
        host = self.host(h)
        for ns, dev in ((host.name, "eth0"), (self.switch, host.port_name)):
            tc = ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]
            out = subprocess.run([*tc, "burst", burst, "latency", latency], capture_output=True, text=True, timeout=20)
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(tc)} failed: {out.stderr.strip()}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            proc.close()
        for name in reversed(self._namespaces):
            _ip("netns", "del", name, check=False)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Network({self.tag}, hosts={[h.addr for h in self.hosts]}, closed={self._closed})"


@pytest.fixture
def network():
    """``network(n)`` builds an n-host test network; all of them are torn down after the test."""
    why = netns_unavailable()
    if why:
        pytest.skip(f"multi-host tests need Linux network namespaces: {why}")
    made: list[Network] = []

    def make(n: int = 2, prefix: str = _PREFIX) -> Network:
        net = Network(n, prefix=prefix)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            net.close()
