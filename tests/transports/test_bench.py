"""``wbridge bench transport`` on one host: the command line (every option documented, combinations
that cannot work refused when written), a sweep read bit-exact, a corrupted region caught, a wrong
token refused, and the server listening on loopback only unless told otherwise. Real processes and
sockets; the two-host runs are in tests/benchmarks/test_bench_two_hosts.py."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from transports.bench import cli
from transports.bench.server import BenchServer

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "bench-test-token"


def _bench(*args: str, token: str | None = TOKEN, timeout: float = 150, entry: str = "transports.bench"):
    """The command in a process of its own: ``python -m transports.bench`` (what ``wbridge bench
    transport`` runs, without importing torch), or ``entry="wbridge"`` for the ``wbridge`` command."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("WBRIDGE_TOKEN", None)
    if token is not None:
        env["WBRIDGE_TOKEN"] = token
    argv = ["wbridge.cli", "bench", "transport"] if entry == "wbridge" else [entry]
    return subprocess.run([sys.executable, "-m", *argv, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def test_help_documents_every_option() -> None:
    actions = [a for a in cli.parser()._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in actions} >= {
        "serve", "connect", "host", "port", "size", "device", "op_size", "sweep", "streams", "depth", "duration",
        "repeat", "no_check", "json", "plot", "against", "transport", "token_env",
    }  # fmt: skip
    undocumented = [a.option_strings[0] for a in actions if not a.help or a.help == argparse.SUPPRESS]
    assert not undocumented, undocumented
    out = _bench("--help", token=None, entry="wbridge")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for a in actions:
        assert a.option_strings[-1] in text and " ".join(a.help.split())[:40] in text, a.option_strings


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--serve", "--op-size", "4MiB"], "the client's choice"),
        (["--serve", "--sweep", "4KiB:1MiB", "--plot", "x.png"], "--sweep, --plot"),
        (["--connect", "h:1", "--port", "5"], "--port is the server's"),
        (["--connect", "h:1", "--ceiling"], "--against raw"),
        (["--host", "10.0.0.1"], "one host runs on loopback"),
        (["--serve", "--host", "0.0.0.0"], "clients are told this address"),
        (["--device", "cuda:0", "--transport", "tcp"], "tcp move host memory only"),
        (["--device", "gpu"], "cpu or cuda:N"),
        (["--transport", "rdma"], "unknown ['rdma']"),
        (["--sweep", "3KiB:1MiB"], "powers of two"),
        (["--op-size", "4MiB", "--sweep", "4KiB:1MiB"], "not allowed with"),
        (["--duration", "1", "--repeat", "2"], "not allowed with"),
        (["--option", "nixl.x=1", "--transport", "tcp"], "nixl is not among"),
        (["--streams", "0"], "at least 1"),
    ],
)
def test_combinations_that_cannot_work_are_refused(args: list[str], says: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_no_token_is_refused_naming_the_variable() -> None:
    for mode in (["--serve"], ["--connect", "127.0.0.1:9"]):
        out = _bench(*mode, "--token-env", "WBB_NO_SUCH_VAR", token=None)
        assert out.returncode == 2 and "WBB_NO_SUCH_VAR" in out.stderr, out.stderr


@pytest.mark.slow
def test_one_host_sweep_reads_every_size_bit_exact_and_plots(tmp_path) -> None:
    png = tmp_path / "sweep.png"
    out = _bench(
        "--transport", "tcp,local", "--size", "16MiB", "--sweep", "1MiB:4MiB", "--streams", "2", "--duration", "0.2",
        "--json", "--plot", str(png), token=None,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    got = [(r["label"], r["op_size"]) for r in res["rows"]]
    assert got == [(t, s << 20) for t in ("tcp", "local") for s in (1, 2, 4)], got
    for r in res["rows"]:
        assert r["verified"] is True and r["checked_bytes"] > 0 and r["reads"] > 0 and r["streams"] == 2, r
        assert r["gbps"] > 0 and r["gbps_peak"] >= r["gbps"] * 0.5 and r["lat_p99_us"] >= r["lat_p50_us"] > 0, r
    assert res["server_status"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def server():
    """A bench server in this process (tcp, 8 MiB, loopback), serving on a thread; its log kept."""
    log = io.StringIO()
    srv = BenchServer("127.0.0.1", 0, TOKEN.encode(), ["tcp"], 8 << 20, log=log)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, log
    srv.close()
    thread.join(10)


def test_a_wrong_token_is_refused_and_the_server_serves_on(server) -> None:
    srv, log = server
    wrong = _bench("--connect", srv.address, token="not-the-token")
    assert wrong.returncode == 1 and "wrong token" in wrong.stderr, wrong.stderr
    assert "refused a client from 127.0.0.1" in log.getvalue(), log.getvalue()
    right = _bench("--connect", srv.address, "--op-size", "1MiB", "--duration", "0.2")
    assert right.returncode == 0, right.stderr
    assert "8MiB ok" in right.stdout, right.stdout


def test_a_corrupted_region_fails_the_check(server) -> None:
    srv, _ = server
    srv.buffer.fill_byte(0x00, (3 << 20) + 5, (3 << 20) + 6)  # one byte the client's reads will bring back
    out = _bench("--connect", srv.address, "--op-size", "1MiB", "--duration", "0.2", "--json")
    assert out.returncode == 1, out.stderr
    (row,) = json.loads(out.stdout)["rows"]
    assert row["verified"] is False, row
    skipped = _bench("--connect", srv.address, "--op-size", "1MiB", "--duration", "0.2", "--no-check", "--json")
    assert skipped.returncode == 0 and json.loads(skipped.stdout)["rows"][0]["verified"] is None


def test_the_server_listens_on_loopback_only_by_default() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, WBRIDGE_TOKEN=TOKEN)
    argv = [sys.executable, "-m", "transports.bench", "--serve", "--port", "0", "--size", "4MiB"]
    proc = subprocess.Popen([*argv, "--json"], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = json.loads(proc.stdout.readline())
        assert line["serving"].startswith("127.0.0.1:"), line
        ss = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=30).stdout.splitlines()
        mine = [x.split()[3] for x in ss if f"pid={line['pid']}," in x]
        assert len(mine) == 2, mine  # the control port and the tcp transport's listener
        assert all(addr.startswith("127.0.0.1:") for addr in mine), mine
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        proc.stdout.close()


@pytest.mark.gpu
def test_a_region_on_a_gpu_holds_the_pattern_and_its_check_sees_one_byte() -> None:
    """``--device cuda:N``: the region (or destination) in device memory, filled and checked in
    chunks through host copies."""
    from transports.bench.memory import CHUNK, Buffer

    buf = Buffer(2 * CHUNK + 12345, "cuda:0")
    try:
        buf.fill_pattern(7)
        assert buf.check(7) and buf.check(7, 99, CHUNK + 5) and not buf.check(8, 0, 4096)
        buf.fill_byte(0xA5, CHUNK + 3, CHUNK + 4)
        assert not buf.check(7) and buf.check(7, 0, CHUNK + 3) and buf.check(7, CHUNK + 4)
    finally:
        buf.close()
