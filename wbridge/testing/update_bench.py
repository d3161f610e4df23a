"""``wbridge bench update --serve`` / ``--connect``: one weight update of a model, trainer hosts to
rollout hosts, timed per version, next to what the transport itself gives between the same hosts.

Trainer host (``--serve``): hosts the channel's store at ``--host:--port``, starts ``--ranks``
publisher processes (a Megatron-like TP split of the model: ``--model`` one of the shipped synthetic
shapes, or ``--params 8B`` a Llama-style model of that size; bf16, optionally published as FP8
blocks with ``--fp8``, and changing a fraction ``--delta RATE`` of its elements per version, served
as deltas), and a transport bench server (``transports.bench``) on the same transport. It writes a
signed record of what it serves, waits for a client's rollouts to join, then publishes
``--versions`` versions in ``sync`` mode (each one read by every rollout before the next), and
after each one signs its trainer stall into the store.

Rollout host (``--connect HOST:PORT``): reads that record (a wrong token fails here), measures the
transport with as many readers as it has rollout ranks (4 MiB reads, ``transports.bench``), starts
``--tp`` subscriber processes (a vLLM-like layout: ``qkv_proj``/``gate_up_proj`` fused unless
``--no-fused``), and prints per version: pull seconds (the slowest rank's), GB/s, bytes, the
trainer's stall and the ratio of the pull's GB/s to the transport's. Each pull is checked bit for
bit against the values the version must hold (``--no-check`` skips it).

The store records of the run live under ``wbridge-bench/update/``, each sealed with the token.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from planner.layout import Shard
from transports.bench.client import ClientPlan, local_address, run_client
from transports.bench.reads import Pattern
from transports.bench.server import BenchServer, unspecified

from ..errors import WBridgeError
from ..options import Delta, Staging
from ..protocol.records import open_sealed, seal
from ..store import open_store
from .synthetic import (
    MODELS,
    ModelConfig,
    bits_view,
    fill_pieces,
    layout_decls,
    make_tensors,
    mismatches,
    set_version,
    version_bits,
)
from .workers import Worker, WorkerError, call_all

CHANNEL = "wbridge-bench"
KEYS = "wbridge-bench/update/"
TOKEN_ENV = "WBRIDGE_TOKEN"
DEFAULT_PORT = 29810
BENCH_BYTES = 256 << 20  # the region the transport is measured on
BENCH_OP = 4 << 20
#: 2-D weights published as FP8 blocks with --fp8 (the embeddings and norms stay bf16, as in DeepSeek-V3)
FP8_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_params(text: str) -> int:
    """``8B`` -> 8e9, ``512M`` -> 5.12e8, ``0.54B``, ``70B``; plain numbers too."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmbtKMBT]?)\s*", text)
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
    value = int(float(m.group(1)) * scale[m.group(2).lower()]) if m else 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (examples: 8B, 512M)")
    return value


def _count(n: int) -> str:
    """``8030261248`` -> ``8.03B``; ``540000000`` -> ``540M``."""
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= k:
            return f"{n / k:.3g}{unit}"
    return str(n)


def _fp8_name(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in FP8_WEIGHTS


def _period(rate: float | None) -> int:
    """The change period (``version_bits``) of a change rate: each element once every 1/rate versions."""
    return 1 if not rate else max(2, round(1 / rate))


# ----------------------------------------------------------------------------------------------
# The two roles, each in its own worker process
# ----------------------------------------------------------------------------------------------
class TrainerRank:
    """One publisher rank: its TP shard of the model (Megatron-like: q/k/v and gate/up apart).

    - ``cfg``: the model. ``rank``, ``ranks``: this rank of the trainer's TP degree.
    - ``url``, ``token``: the channel's store and token. ``host``: the address its transport binds.
    - ``transport``: the one transport served. ``fp8``: publish the 2-D weights as FP8 blocks.
    - ``period``: each element changes once every ``period`` versions (>1: deltas are published).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        rank: int,
        ranks: int,
        url: str,
        token: str,
        host: str,
        transport: str,
        fp8: bool,
        period: int,
    ) -> None:
        from ..publisher import Publisher

        self.period = period
        self.tensors = make_tensors(cfg, ranks, rank, fused=False, version=None)
        staging = Staging(slots=2, delta=Delta()) if period > 1 else Staging(slots=1)
        self.pub = Publisher(
            CHANNEL, url, rank=rank, world_size=ranks, token=token, transport=[transport], mode="sync",
            staging=staging, host=host,
        )  # fmt: skip
        transforms = {n: "fp8_block128" for n in self.tensors if _fp8_name(n)} if fp8 else None
        self.pub.register(self.tensors, transforms=transforms)

    def wait_subscribers(self, n: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.pub.live_subscribers() < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} rollout ranks did not join within {timeout:.0f}s")
            time.sleep(0.05)
        return self.pub.live_subscribers()

    def step(self, version: int) -> None:
        """A fake training step: the tensors take their values of ``version``."""
        set_version(self.tensors, version, self.period)

    def publish(self, timeout: float) -> dict:
        v = self.pub.publish(timeout=timeout)
        s = self.pub.stats.last
        return {"version": v, "stall_s": s.stall_s, "delta_s": s.delta_s, "seconds": s.seconds}

    def close(self) -> None:
        self.pub.close()


def check_fp8(cfg: ModelConfig, ranks: int) -> None:
    """``UsageError`` naming the first weight whose shard on one of ``ranks`` trainer ranks does not
    cover whole 128x128 blocks (what ``--fp8`` needs), before any process starts."""
    from ..publish.transforms import fp8_block128_layout

    for r in range(ranks):
        for name, (shape, decl) in layout_decls(cfg, ranks, r, fused=False).items():
            if _fp8_name(name):
                fp8_block128_layout(name, shape, decl, f"--fp8 with --ranks {ranks}, rank {r}")


def rollout_tensors(cfg: ModelConfig, tp: int, rank: int, *, fused: bool, fp8: bool) -> dict[str, tuple[Any, Any]]:
    """Rank ``rank`` of a TP-``tp`` rollout: bf16 tensors, or with ``fp8`` its 2-D weights in
    ``float8_e4m3fn`` plus every such weight's ``_scale_inv`` whole; filled with garbage."""
    import torch

    tensors = make_tensors(cfg, tp, rank, fused=fused, version=None, fill_value=0xFF)
    if not fp8:
        return tensors
    out = {}
    for name, (t, decl) in tensors.items():
        parts = getattr(decl, "parts", None) or [decl]
        if _fp8_name(parts[0].name):
            t = torch.full(t.shape, 0xFF, dtype=torch.uint8).view(torch.float8_e4m3fn)
        out[name] = (t, decl)
    for spec in cfg.specs():
        if _fp8_name(spec.name):
            shape = tuple(math.ceil(n / 128) for n in spec.shape)
            out[spec.name + "_scale_inv"] = (torch.full(shape, float("nan")), Shard(spec.name + "_scale_inv", shape))
    return out


def set_fp8_version(cfg: ModelConfig, tensors: dict[str, tuple[Any, Any]], version: int, period: int) -> None:
    """Writes into a ``rollout_tensors(fp8=True)`` rank's tensors what the trainer publishes at
    ``version``: each transformed canonical weight is quantised here whole, as
    ``wbridge.publish.transforms.Fp8Block128`` does on the trainer, and read into this layout; the
    other tensors take their bf16 values."""
    import torch

    from ..publish.transforms import Fp8Block128

    quantised: dict[str, np.ndarray] = {}
    for spec in cfg.specs():
        if _fp8_name(spec.name):
            full = (0,) * len(spec.shape)
            bits = version_bits(spec.name, spec.shape, full, spec.shape, 2, version, period)
            src = torch.from_numpy(np.array(bits).view(np.int16)).view(torch.bfloat16)
            w = torch.empty(spec.shape, dtype=torch.float8_e4m3fn)
            s = torch.empty(tuple(math.ceil(n / 128) for n in spec.shape), dtype=torch.float32)
            Fp8Block128(w, s).copy_(src)
            quantised[spec.name] = w.view(torch.uint8).numpy()
            quantised[spec.name + "_scale_inv"] = s.view(torch.int32).numpy().view(np.uint32)

    def source(tensor: str, shape: tuple, offsets: tuple, sizes: tuple) -> np.ndarray:
        return quantised[tensor][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]

    plain = {}
    for name, (t, decl) in tensors.items():
        parts = getattr(decl, "parts", None) or [decl]
        if parts[0].name in quantised:
            fill_pieces(bits_view(t), name, tuple(t.shape), decl, t.element_size(), source)
        else:
            plain[name] = (t, decl)
    set_version(plain, version, period)


def fp8_mismatches(cfg: ModelConfig, tensors: dict[str, tuple[Any, Any]], version: int, period: int) -> list[str]:
    """Names of a ``rollout_tensors(fp8=True)`` rank's tensors that differ from what the trainer
    publishes at ``version`` (``set_fp8_version``)."""
    want = {n: (t.clone(), d) for n, (t, d) in tensors.items()}
    set_fp8_version(cfg, want, version, period)
    return [n for n, (t, _) in tensors.items() if not np.array_equal(bits_view(t), bits_view(want[n][0]))]


class RolloutRank:
    """One subscriber: rank ``rank`` of a TP-``tp`` rollout (vLLM-like when ``fused``).

    - ``cfg``, ``tp``, ``rank``, ``fused``, ``fp8``, ``period``: the model, the layout, what is published.
    - ``url``, ``token``, ``host``, ``transport``: the channel and this side's transport.
    - ``check``: compare each pulled version with the values it must hold.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tp: int,
        rank: int,
        url: str,
        token: str,
        host: str,
        transport: str,
        fused: bool,
        fp8: bool,
        period: int,
        check: bool,
    ) -> None:
        from ..subscriber import Subscriber

        self.cfg, self.fp8, self.period, self.check = cfg, fp8, period, check
        self.tensors = rollout_tensors(cfg, tp, rank, fused=fused, fp8=fp8)
        self.sub = Subscriber(CHANNEL, url, token=token, transport=transport, host=host, name=f"rollout-{rank}")
        self.sub.register(self.tensors)

    def pull(self, version: int, timeout: float) -> dict:
        got = self.sub.pull(min_version=version, timeout=timeout)
        st = self.sub.stats.last
        bad: list[str] = []
        if self.check:
            if self.fp8:
                bad = fp8_mismatches(self.cfg, self.tensors, got, self.period)
            else:
                bad = mismatches(self.tensors, got, self.period)
        return {
            "version": got,
            "seconds": st.seconds,
            "nbytes": st.nbytes,
            "delta": st.delta,
            "delta_reason": st.delta_reason,
            "bad": bad[:5],
            "transport": sorted({n for n, _ in self.sub.stats.transports.values()}),
        }

    def close(self) -> None:
        self.sub.close()


# ----------------------------------------------------------------------------------------------
# The store records of a run
# ----------------------------------------------------------------------------------------------
def _put(store: Any, token: bytes, name: str, payload: Any) -> None:
    store.set(KEYS + name, seal(token, KEYS + name, payload))


def _get(store: Any, token: bytes, name: str, timeout: float) -> Any:
    """The record ``name``, waited for up to ``timeout`` s; ``AuthError`` if not sealed with ``token``."""
    raw = store.wait(KEYS + name, timeout)
    return open_sealed(token, KEYS + name, raw)


def _context() -> Any:
    ctx = mp.get_context("forkserver")  # torch and wbridge are imported once, not per process
    ctx.set_forkserver_preload(["torch", "numpy", "wbridge.publisher", "wbridge.subscriber"])
    return ctx


def _workers(specs: list[tuple[str, Any, tuple]], timeout: float) -> list[Worker]:
    ctx = _context()
    workers = [Worker(name, cls, *args, timeout=None, context=ctx) for name, cls, args in specs]
    try:
        deadline = time.monotonic() + timeout
        for w in workers:
            w.result(max(1.0, deadline - time.monotonic()))
    except BaseException:
        _stop(workers)
        raise
    return workers


def _stop(workers: Sequence[Worker]) -> None:
    for w in workers:
        w.stop()


def _say(msg: str) -> None:
    print(f"wbridge bench update: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# --serve
# ----------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace, token: bytes) -> int:
    cfg = ModelConfig.from_params(args.params) if args.params else ModelConfig.named(args.model)
    period = _period(args.delta)
    if args.fp8:
        check_fp8(cfg, args.ranks)
    host, port = args.host or "127.0.0.1", DEFAULT_PORT if args.port is None else args.port
    url = f"tcp://{host}:{port}"
    store = open_store(url, host_store=True)
    bench = BenchServer(host, 0, token, [args.transport], min(BENCH_BYTES, max(cfg.nbytes, 4 * BENCH_OP)))
    threading.Thread(target=bench.serve_forever, name="wbridge-bench-transport", daemon=True).start()
    workers: list[Worker] = []
    try:
        _say(f"{cfg.nbytes / 2**30:.2f} GiB model, starting {args.ranks} trainer ranks ...")
        served = (url, token.decode(), host, args.transport, args.fp8, period)
        specs = [(f"trainer-{r}", TrainerRank, (cfg, r, args.ranks, *served)) for r in range(args.ranks)]
        workers = _workers(specs, args.timeout)
        info = {
            "model": asdict(cfg),
            "label": f"--params {_count(args.params)}" if args.params else args.model,
            "ranks": args.ranks,
            "transport": args.transport,
            "fp8": args.fp8,
            "period": period,
            "versions": args.versions,
            "bench": bench.address,
        }
        _put(store, token, "info", info)
        connect = f"wbridge bench update --connect {host}:{port}"
        if args.json:
            print(json.dumps({"serving": f"{host}:{port}", "token_env": args.token_env, "connect": connect, **info}))
        else:
            print(
                f"wbridge bench update: serving {info['label']} ({cfg.nbytes / 2**30:.2f} GiB bf16"
                f"{', FP8 blocks' if args.fp8 else ''}{f', 1/{period} changing per version' if period > 1 else ''}, "
                f"{args.ranks} trainer ranks) on {args.transport} at {host}:{port}; on the rollout host: "
                f"{args.token_env}=<the same token> {connect}",
                flush=True,
            )
        go = _get(store, token, "go", args.wait)
        call_all(workers, "wait_subscribers", go["subscribers"], args.timeout, call_timeout=args.timeout + 30)
        for v in range(1, args.versions + 1):
            call_all(workers, "step", v, call_timeout=args.timeout)
            got = call_all(workers, "publish", args.timeout, call_timeout=args.timeout + 30)
            rec = {
                "version": got[0]["version"],
                "stall_s": max(g["stall_s"] for g in got),
                "delta_s": max(g["delta_s"] for g in got),
                "publish_s": max(g["seconds"] for g in got),
            }
            _put(store, token, f"v/{v}", rec)
            _say(f"version {v}: trainer stall {rec['stall_s']:.3f} s, publish {rec['publish_s']:.3f} s")
        _get(store, token, "done", args.timeout + args.versions * args.timeout)
        return 0
    finally:
        _stop(workers)
        bench.close()
        store.close()


# ----------------------------------------------------------------------------------------------
# --connect
# ----------------------------------------------------------------------------------------------
def connect(args: argparse.Namespace, token: bytes) -> int:
    host, _, port = args.connect.rpartition(":")
    host = host.strip("[]")
    url = f"tcp://{host}:{port}"
    local = args.host or local_address(host, int(port))
    store = open_store(url)
    workers: list[Worker] = []
    try:
        info = _get(store, token, "info", args.timeout)
        cfg = ModelConfig(**info["model"])
        bhost, _, bport = info["bench"].rpartition(":")
        plan = ClientPlan((info["transport"],), (BENCH_OP,), Pattern(BENCH_OP, streams=args.tp, duration=args.bench_s))
        measured = run_client(bhost.strip("[]"), int(bport), token, plan, local_host=local, timeout=args.timeout)
        link = measured["rows"][0]
        _say(f"{info['transport']} between the hosts: {link['gbps']:.3f} GB/s ({args.tp} readers of 4MiB reads)")
        specs = [
            (f"rollout-{r}", RolloutRank, (cfg, args.tp, r, url, token.decode(), local, info["transport"],
                                           args.fused, info["fp8"], info["period"], not args.no_check))
            for r in range(args.tp)
        ]  # fmt: skip
        workers = _workers(specs, args.timeout)
        _put(store, token, "go", {"subscribers": args.tp})
        rows = []
        for v in range(1, info["versions"] + 1):
            pulls = call_all(workers, "pull", v, args.timeout, call_timeout=args.timeout + 60)
            rec = _get(store, token, f"v/{v}", args.timeout)
            seconds = max(p["seconds"] for p in pulls)
            nbytes = sum(p["nbytes"] for p in pulls)
            gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            rows.append(
                {
                    "version": v,
                    "pull_s": seconds,
                    "gbps": gbps,
                    "bytes": nbytes,
                    "stall_s": rec["stall_s"],
                    "vs_transport": gbps / link["gbps"] if link["gbps"] > 0 else None,
                    "deltas": sum(p["delta"] for p in pulls),
                    "exact": None if args.no_check else not any(p["bad"] for p in pulls),
                    "bad": [b for p in pulls for b in p["bad"]][:5],
                }
            )
            if not args.json:
                _say(f"version {v} pulled in {seconds:.3f} s")
        _stop(workers)  # the rollouts leave the channel while the server's store is still up
        _put(store, token, "done", {"versions": len(rows)})
    finally:
        _stop(workers)
        store.close()
    result = {"model": info, "tp": args.tp, "fused": args.fused, "transport_gbps": link["gbps"], "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        print(_table(result, cfg))
    return 0 if all(r["exact"] is not False for r in rows) else 1


def _table(result: dict, cfg: ModelConfig) -> str:
    info = result["model"]
    head = (
        f"wbridge bench update: {info['label']} ({cfg.nbytes / 2**30:.2f} GiB bf16"
        f"{', FP8 blocks' if info['fp8'] else ''}), {info['ranks']} trainer ranks -> TP={result['tp']} rollout "
        f"({'fused' if result['fused'] else 'not fused'}) over {info['transport']}; the transport: "
        f"{result['transport_gbps']:.3f} GB/s"
    )
    lines = [head, f"{'version':>7} {'pull s':>8} {'GB/s':>7} {'MiB':>9} {'stall s':>8} {'vs transport':>12} "
             f"{'deltas':>6} {'bit-exact':>9}"]  # fmt: skip
    for r in result["rows"]:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        ratio = "-" if r["vs_transport"] is None else f"{r['vs_transport']:.2f}"
        lines.append(
            f"{r['version']:>7} {r['pull_s']:>8.3f} {r['gbps']:>7.3f} {r['bytes'] / 2**20:>9.1f} {r['stall_s']:>8.3f} "
            f"{ratio:>12} {r['deltas']:>6} {exact:>9}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="wbridge bench update",
        description=__doc__.split("\n\n")[0].replace("``", "")
        + "\n\n  trainer host: WBRIDGE_TOKEN=... wbridge bench update --serve --host 10.0.0.5 --params 8B --ranks 8"
        "\n  rollout host: WBRIDGE_TOKEN=... wbridge bench update --connect 10.0.0.5:29810 --tp 8\n\n"
        "Without --serve or --connect it runs benchmarks/update_e2e.py of a source checkout (one host, "
        "against gather-and-broadcast) with the other arguments; see python benchmarks/update_e2e.py --help.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", action="store_true", help="the trainer host: publishers and the channel's store")
    mode.add_argument("--connect", metavar="HOST:PORT", help="the rollout host: subscribers of the server at HOST:PORT")
    ap.add_argument(
        "--host",
        help="--serve: the address the store and transports bind and advertise (default 127.0.0.1); --connect: "
        "this host's address for the transports (default: its address on the route to the server)",
    )
    ap.add_argument("--port", type=int, help=f"--serve: the store's port (default {DEFAULT_PORT})")
    ap.add_argument("--token-env", default=TOKEN_ENV, metavar="VAR", help="the variable holding the shared token")
    srv = ap.add_argument_group("the trainer (--serve)")
    model = srv.add_mutually_exclusive_group()
    model.add_argument("--model", choices=MODELS, default=None, help="a shipped synthetic shape (default 1g)")
    model.add_argument("--params", type=parse_params, help="a synthetic Llama-style model of this size: 8B, 512M")
    srv.add_argument("--ranks", type=int, default=None, help="publisher ranks (the trainer's TP degree; default 1)")
    srv.add_argument("--transport", default=None, help="the transport served and read (default tcp)")
    srv.add_argument("--fp8", action="store_true", default=None, help="publish the 2-D weights as FP8 128x128 blocks")
    srv.add_argument(
        "--delta",
        type=float,
        default=None,
        metavar="RATE",
        help="a fraction of the elements changes per version (e.g. 0.03); deltas are published",
    )
    srv.add_argument("--versions", type=int, default=None, help="versions published (default 3)")
    srv.add_argument("--wait", type=float, default=None, help="seconds to wait for the rollout host (default 3600)")
    cli = ap.add_argument_group("the rollout (--connect)")
    cli.add_argument("--tp", type=int, default=None, help="rollout ranks, each a subscriber (default 2)")
    cli.add_argument("--fused", action=argparse.BooleanOptionalAction, default=None, help="fused qkv/gate_up (default)")
    cli.add_argument("--no-check", action="store_true", default=None, help="do not check each pull bit for bit")
    cli.add_argument("--bench-s", type=float, default=None, help="seconds the transport is measured (default 2)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one step may take")
    return ap


SERVER_ONLY = {"model": "1g", "params": None, "ranks": 1, "transport": "tcp", "fp8": False, "delta": None,
               "versions": 3, "wait": 3600.0}  # fmt: skip
CLIENT_ONLY = {"tp": 2, "fused": True, "no_check": False, "bench_s": 2.0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    mine, theirs = (SERVER_ONLY, CLIENT_ONLY) if args.serve else (CLIENT_ONLY, SERVER_ONLY)
    wrong = ["--" + k.replace("_", "-") for k in theirs if getattr(args, k) is not None]
    if wrong:
        ap.error(f"{', '.join(wrong)}: not for {'--serve' if args.serve else '--connect'} (the other host says it)")
    if args.connect and args.port is not None:
        ap.error("--port is the server's; a client names it in --connect HOST:PORT")
    for k, v in mine.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.serve:
        if args.ranks < 1 or args.versions < 1:
            ap.error("--ranks and --versions must be at least 1")
        if args.delta is not None and not 0 < args.delta <= 0.5:
            ap.error("--delta is the fraction of elements changed per version, in (0, 0.5]")
        if args.host and unspecified(args.host):
            ap.error(f"--host {args.host}: rollouts are told this address; give this host's address on their network")
        if args.transport in ("auto", "local"):
            ap.error(f"--transport {args.transport}: name a transport that crosses hosts (tcp, nixl, mooncake, nccl)")
    elif args.tp < 1:
        ap.error("--tp must be at least 1")
    if args.connect:
        host, sep, port = args.connect.rpartition(":")
        if not sep or not host or not port.isdigit():
            ap.error(f"--connect takes HOST:PORT, not {args.connect!r}")
    token = os.environ.get(args.token_env, "")
    if not token:
        ap.error(f"set the shared token in the environment variable {args.token_env} (the same on both hosts)")
    try:
        return serve(args, token.encode()) if args.serve else connect(args, token.encode())
    except WorkerError as e:  # a rank failed: its exception's last line says why (the rest went to stderr)
        print(f"wbridge bench update: error: {e.args[0].splitlines()[0]} {e.args[0].strip().splitlines()[-1]}",
              file=sys.stderr)  # fmt: skip
        return 1
    except (WBridgeError, TimeoutError, OSError, ValueError) as e:
        print(f"wbridge bench update: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
