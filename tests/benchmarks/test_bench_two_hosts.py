"""``wbridge bench transport`` and ``wbridge bench update`` between two hosts, as a user runs them:
a server in one network namespace, a client in another, every link shaped with ``tc tbf`` to
400 Mbit/s (``tests/hosts.py``). On a shaped link the bandwidth is the link's whatever the load on
the machine, so the figures are checked against the rate itself.

Done-when of issue 35: tcp, nixl and mooncake (where they install) each read 4 MiB ops at 0.85-1.05
of the shaped rate with every byte checked; the server refuses a client with another token; a
``--plot`` PNG is drawn; and a 1 GiB synthetic model pulled by a TP=2 rollout takes at most 1.2x its
bytes over the shaped rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import transports
from tests.hosts import Host, network  # noqa: F401 - fixture

pytestmark = [pytest.mark.netns, pytest.mark.slow]

RATE = "400mbit"
RATE_GBPS = 400e6 / 8 / 1e9  # what tc's "400mbit" lets through, in GB/s (10**9 bytes)
TOKEN = "wbb-right-token"


def _shaped(network) -> tuple[Host, Host, dict]:
    net = network(2, prefix="wbb")
    for h in net.hosts:
        net.shape(h, RATE)
    # in one kernel UCX would reach the other namespace through shared memory: keep nixl on the link
    env = dict(net.env, WBRIDGE_TOKEN=TOKEN, UCX_TLS="tcp")
    return net.hosts[0], net.hosts[1], env


def _wbridge(host: Host, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    argv = host.exec_prefix + [sys.executable, "-m", "wbridge.cli", "bench", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def _listening(host: Host) -> list[str]:
    """Local addresses of every listening TCP socket in the host's namespace (from the kernel: ``ss``)."""
    out = host.run(["ss", "-Hltn"])
    assert out.returncode == 0, out.stderr
    return [line.split()[3] for line in out.stdout.splitlines() if line.strip()]


def _wait_for(text: str, proc, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while text not in proc.stderr() and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc.stderr()


@pytest.mark.timeout(300)
def test_transport_bench_between_two_hosts_reads_at_the_shaped_rate(network, tmp_path) -> None:
    a, b, env = _shaped(network)
    names = [t for t in ("tcp", "nixl", "mooncake") if t in transports.available()]
    server = a.popen(
        [sys.executable, "-u", "-m", "wbridge.cli", "bench", "transport", "--serve", "--host", a.addr,
         "--port", "29800", "--transport", ",".join(names), "--size", "64MiB", "--json"],
        env=env,
    )  # fmt: skip
    line = server.recv(120)
    assert line["serving"] == f"{a.addr}:29800" and line["transports"] == names, line
    # bound to the address given: the control port, tcp, NIXL's UCX; only Mooncake's two listeners
    # take every interface whatever it is told (docs/security.md)
    elsewhere = [x for x in _listening(a) if not x.startswith(a.addr + ":")]
    assert f"{a.addr}:29800" in _listening(a) and len(elsewhere) == 2 * ("mooncake" in names), elsewhere

    wrong = _wbridge(b, ["transport", "--connect", f"{a.addr}:29800"], dict(env, WBRIDGE_TOKEN="wrong"), 120)
    assert wrong.returncode == 1 and "wrong token" in wrong.stderr, wrong
    assert "refused a client from " + b.addr in _wait_for("refused a client", server, 10)

    png = tmp_path / "transport.png"
    # the link sets the rate, unless the machine starves a transport's threads for a second of the
    # run (seen: nixl at 0.74 of the rate at load 14, and at 0.84 then 0.78 in two runs beside the
    # suite's engines): where one is short of it, the client runs again, up to twice
    at_rate: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(3):
        run = _wbridge(
            b,
            ["transport", "--connect", f"{a.addr}:29800", "--op-size", "4MiB", "--depth", "4", "--duration", "4",
             "--json", "--plot", str(png)],
            env,
            240,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        res = json.loads(run.stdout.strip().splitlines()[-1])
        assert [r["label"] for r in res["rows"]] == names
        for r in res["rows"]:
            assert r["op_size"] == 4 << 20 and r["verified"] is True and r["checked_bytes"] >= 16 << 20, r
            at_rate[r["label"]].append(r["gbps"] / RATE_GBPS)
        if all(any(0.85 <= x <= 1.05 for x in xs) for xs in at_rate.values()):
            break
    assert all(any(0.85 <= x <= 1.05 for x in xs) for xs in at_rate.values()), at_rate
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert server.popen.poll() is None, "the server serves on after its clients"


@pytest.mark.timeout(800)
def test_update_bench_between_two_hosts_pulls_at_the_shaped_rate(network) -> None:
    a, b, env = _shaped(network)
    # the link sets the pace, unless the machine starves the pull's threads (seen once beside the
    # suite's engines: 136 s for 22 s of bytes): a pull out of the band gets one more server and client
    for attempt in range(2):
        row, res, at_rate = _update_bench(a, b, env, 29810 + attempt)
        if 0.9 * at_rate <= row["pull_s"] <= 1.2 * at_rate and 0.85 <= res["transport_gbps"] / RATE_GBPS <= 1.05:
            break
    assert 0.9 * at_rate <= row["pull_s"] <= 1.2 * at_rate, (row, at_rate)
    assert 0.85 <= res["transport_gbps"] / RATE_GBPS <= 1.05, res["transport_gbps"]


def _update_bench(a: Host, b: Host, env: dict, port: int) -> tuple[dict, dict, float]:
    """One ``wbridge bench update`` server on ``a`` and its client on ``b``: the client's row, its
    whole result, and the seconds the row's bytes take at the shaped rate."""
    server = a.popen(
        [sys.executable, "-u", "-m", "wbridge.cli", "bench", "update", "--serve", "--host", a.addr,
         "--port", str(port), "--params", "0.54B", "--ranks", "2", "--versions", "1", "--json"],
        env=env,
    )  # fmt: skip
    info = server.recv(240)
    assert info["serving"] == f"{a.addr}:{port}" and info["ranks"] == 2, info
    listening = _listening(a)  # the store, the publishers' and the bench server's: A's address only
    assert f"{a.addr}:{port}" in listening and all(x.startswith(a.addr + ":") for x in listening), listening

    run = _wbridge(b, ["update", "--connect", f"{a.addr}:{port}", "--tp", "2", "--json"], env, 330)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    (row,) = res["rows"]
    assert row["exact"] is True and row["bytes"] >= 1 << 30, row  # TP=2: the two halves of 1 GiB and more
    assert server.popen.wait(60) == 0, server.stderr()
    return row, res, row["bytes"] / (RATE_GBPS * 1e9)  # seconds the bytes take at the shaped rate
