"""``wbridge bench transport``: the command line (also ``python -m transports.bench``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence

import transports

from ..errors import TransportError
from .client import ClientPlan, device_refusal, run_client
from .loopback import memcpy_ceiling, run_loopback
from .memory import check_device
from .raw import iperf3_loopback
from .reads import Pattern, SizeResult
from .report import plot, plot_available, table
from .server import BenchServer, announce, unspecified
from .units import human, parse_size, parse_sweep

DEFAULT_PORT = 29800
TOKEN_ENV = "WBRIDGE_TOKEN"

DESCRIPTION = """\
Transport throughput, as perftest measures it: a server holds a registered region, a client on
another host reads it and prints, per op size, bytes, reads, bandwidth (average and peak, GB/s =
10^9 bytes/s), read latency p50/p99 and the bytes checked against what the server holds.

  server host:  WBRIDGE_TOKEN=... wbridge bench transport --serve --host 10.0.0.5 --transport tcp,nixl
  client host:  WBRIDGE_TOKEN=... wbridge bench transport --connect 10.0.0.5:29800 --sweep 4KiB:64MiB

Without --serve or --connect it measures this host alone: a server on loopback for the run.
"""

EPILOG = """\
Reading: each of --streams readers has its own connection (transport instance) and its own slice
of the region, and posts --depth reads at a time, each post waiting for all of its reads. Latency
is the time of a post (one read at --depth 1). The peak is the best tenth of the run. Bytes checked:
every byte read is compared with the region's pattern after each op size.

The token: the server and the client read it from the same environment variable (--token-env);
the server refuses a client that cannot prove it, and tcp peers authenticate with it (nixl and
mooncake engines have no authentication: their endpoints are given to authenticated clients only).
"""

# options of the reading side, and their defaults (applied after the checks)
READING = {
    "op_size": parse_size("4MiB"),
    "sweep": None,
    "streams": 1,
    "depth": None,
    "duration": None,
    "repeat": None,
    "no_check": False,
    "against": None,
    "plot": None,
    "ceiling": False,
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="wbridge bench transport",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = ap.add_argument_group("mode (neither: this host alone)").add_mutually_exclusive_group()
    mode.add_argument(
        "--serve",
        action="store_true",
        help="hold a registered region and serve it until interrupted; prints one line a client can use",
    )
    mode.add_argument("--connect", metavar="HOST:PORT", help="read the region of the server at HOST:PORT")
    where = ap.add_argument_group("where")
    where.add_argument(
        "--host",
        help="--serve: the address to bind and advertise (default 127.0.0.1: give this host's address on "
        "the network to serve others; never all interfaces); --connect: this host's address for the "
        "transports (default: its address on the route to the server)",
    )
    where.add_argument(
        "--port", type=int, help=f"--serve: the control port the client connects to (default {DEFAULT_PORT}; 0: any)"
    )
    where.add_argument(
        "--token-env",
        default=TOKEN_ENV,
        metavar="VAR",
        help=f"the environment variable that holds the shared token (default {TOKEN_ENV}); the same on both "
        "hosts: a client with another token is refused",
    )
    what = ap.add_argument_group("what")
    what.add_argument(
        "--transport",
        default=None,
        metavar="T[,T...]",
        help="transports (tcp, local, mooncake, nixl, nccl): --serve: what to serve (default tcp); "
        "--connect: what to read (default: everything the server serves); one host: default tcp",
    )
    what.add_argument(
        "--size",
        type=parse_size,
        default=None,
        help="--serve and one host: bytes of the region (default 1GiB); --connect: read only its first SIZE bytes",
    )
    what.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda:N: where the region (--serve) or the destination (--connect) lives; "
        "GPU memory needs a transport that reaches it (nixl)",
    )
    what.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="[T.]KEY=VALUE",
        help="a transport constructor keyword (JSON value), for transport T or all of them: tcp.window=4, "
        'protocol="tcp"',
    )
    how = ap.add_argument_group("how the client reads (--connect and one host)")
    sizes = how.add_mutually_exclusive_group()
    sizes.add_argument("--op-size", type=parse_size, default=None, help="bytes per read (default 4MiB)")
    sizes.add_argument(
        "--sweep",
        type=parse_sweep,
        default=None,
        metavar="LOW:HIGH",
        help="every power of two from LOW to HIGH as the op size, in turn (e.g. 4KiB:64MiB)",
    )
    how.add_argument(
        "--streams", type=int, default=None, help="readers side by side, each with its own connection (default 1)"
    )
    how.add_argument(
        "--depth",
        type=int,
        default=None,
        help="reads in flight per reader, posted together (default 16, fewer above 4MiB: at most 64MiB a post)",
    )
    runs = how.add_mutually_exclusive_group()
    runs.add_argument("--duration", type=float, default=None, help="seconds of timed reads per op size (default 2)")
    runs.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="instead of --duration: how many times each reader reads all its batches (up to 64 batches each)",
    )
    how.add_argument("--no-check", action="store_true", default=None, help="do not check the bytes read")
    how.add_argument(
        "--against",
        choices=["raw"],
        default=None,
        help="raw: also read the same way through the engine underneath (NIXL agent, Mooncake engine; "
        "iperf3 for tcp) and print wbridge/raw per size",
    )
    out = ap.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object instead of the table (--serve: its line)")
    out.add_argument(
        "--plot", metavar="FILE.png", default=None, help="bandwidth against op size, one line per transport"
    )
    out.add_argument(
        "--ceiling", action="store_true", default=None, help="one host: also the memcpy and iperf3 loopback ceilings"
    )
    out.add_argument("--timeout", type=float, default=120.0, help="seconds a post or a connection may take")
    return ap


def _options(ap: argparse.ArgumentParser, items: list[str], names: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {n: {} for n in names}
    for kv in items:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--option takes [TRANSPORT.]KEY=VALUE, not {kv!r}")
        scope, dot, name = key.rpartition(".")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        for t in [scope] if dot else names:
            if t not in out:
                ap.error(f"--option {kv}: {t} is not among the transports {names}")
            out[t][name] = parsed
    return out


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses combinations that cannot work, naming what to write instead; fills the defaults."""
    given = [k for k in READING if getattr(args, k) is not None and getattr(args, k) is not False]
    if args.serve and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        ap.error(f"{flags}: how to read is the client's choice (--connect), not the server's")
    if not args.serve and args.port is not None:
        ap.error("--port is the server's (--serve); a client names it in --connect HOST:PORT")
    if not args.serve and not args.connect and args.host is not None:
        ap.error("--host is for --serve or --connect; one host runs on loopback")
    if args.serve and args.host and unspecified(args.host):
        ap.error(f"--host {args.host}: clients are told this address; give this host's address on their network")
    if args.connect and args.ceiling:
        ap.error("--ceiling measures this host alone; between hosts use --against raw")
    for k, v in READING.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.duration is None and args.repeat is None:
        args.duration = 2.0
    if args.streams < 1 or (args.depth is not None and args.depth < 1):
        ap.error("--streams and --depth must be at least 1")
    if (args.duration is not None and args.duration <= 0) or (args.repeat is not None and args.repeat < 1):
        ap.error("--duration must be positive and --repeat at least 1")
    if args.plot and plot_available():
        ap.error(plot_available())
    try:
        args.device = check_device(args.device)
    except ValueError as e:
        ap.error(f"--device: {e}")
    names = [n for n in (args.transport or "").split(",") if n]
    unknown = [n for n in names if n not in transports.REGISTRY]
    if unknown:
        ap.error(f"--transport: unknown {unknown}; known: {sorted(transports.REGISTRY)}")
    if not args.connect:
        names = names or ["tcp"]
    if names:
        try:
            why = device_refusal(names, args.device)
        except TransportError as e:
            ap.error(f"--transport: {e}")
        if why:
            ap.error(f"--device {args.device}: {why}")
    args.transports = names
    args.options_by = _options(ap, args.option, names or list(transports.REGISTRY))


def _token(ap: argparse.ArgumentParser, var: str) -> bytes:
    token = os.environ.get(var, "")
    if not token:
        ap.error(f"set the shared token in the environment variable {var} (the same on the server and the client)")
    return token.encode()


def _progress(res: SizeResult) -> None:
    check = "" if res.verified is None else (" bytes ok" if res.verified else " BYTES DIFFER")
    print(f"  {res.label} {human(res.op_size)}: {res.gbps:.3f} GB/s{check}", file=sys.stderr, flush=True)


def _stop_on_sigterm() -> None:
    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def serve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    token = _token(ap, args.token_env)
    _stop_on_sigterm()
    host = args.host or "127.0.0.1"
    port = DEFAULT_PORT if args.port is None else args.port
    size = args.size or parse_size("1GiB")
    try:
        server = BenchServer(host, port, token, args.transports, size, device=args.device, options=args.options_by)
    except (TransportError, ImportError) as e:
        print(f"wbridge bench transport: error: {e}", file=sys.stderr)
        return 1
    try:
        announce(server, args.token_env, args.json, sys.stdout)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    if args.serve:
        return serve(ap, args)
    pattern = Pattern(
        args.op_size,
        depth=args.depth,
        streams=args.streams,
        duration=args.duration,
        repeat=args.repeat,
        check=not args.no_check,
        timeout=args.timeout,
    )
    plan = ClientPlan(
        tuple(args.transports),
        tuple(args.sweep or [args.op_size]),
        pattern,
        device=args.device,
        span=args.size if args.connect else None,
        against_raw=args.against == "raw",
        options=args.options_by,
    )
    progress = None if args.json else _progress
    try:
        if args.connect:
            host, sep, port = args.connect.rpartition(":")
            if not sep or not port.isdigit() or not host:
                ap.error(f"--connect takes HOST:PORT, not {args.connect!r}")
            token = _token(ap, args.token_env)
            res = run_client(
                host.strip("[]"), int(port), token, plan, local_host=args.host, timeout=args.timeout, progress=progress
            )
            where = f"{res['local']} reading {res['server']}"
        else:
            size = args.size or parse_size("1GiB")
            res = run_loopback(args.transports, size, args.device, plan, timeout=args.timeout, progress=progress)
            where = "one host (loopback)"
            if args.ceiling:
                res["memcpy_gbps"] = memcpy_ceiling(size)
                res["iperf3_gbps"] = iperf3_loopback(size)
    except (TransportError, ValueError, ImportError) as e:
        print(f"wbridge bench transport: error: {e}", file=sys.stderr)
        return 1
    res["pattern"] = {
        "streams": args.streams,
        "depth": args.depth,
        "duration": args.duration,
        "repeat": args.repeat,
        "device": args.device,
    }
    if args.plot:
        depth = args.depth or "16 (at most 64MiB a post)"
        title = f"{where}\n{human(res['size'])} region, {args.streams} stream(s), depth {depth}"
        res["plot"] = plot(res, args.plot, title)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"wbridge bench transport: {where}, region {human(res['size'])}, {args.streams} stream(s)")
        print(table(res["rows"]))
        for k in ("memcpy_gbps", "iperf3_gbps"):
            if k in res:
                value = "n/a" if res[k] is None else f"{res[k]:.3f}"
                print(f"{k.replace('_gbps', '')} ceiling: {value} GB/s")
        if args.plot:
            print(f"plot: {res['plot']}")
    bad = [r for r in res["rows"] if r["verified"] is False]
    return 1 if bad or res.get("server_status") not in (None, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
