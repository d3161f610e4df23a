"""Cross-cluster update through zone relays: link bytes and time, with relays and without.

Run (as root: it makes network namespaces): ``PYTHONPATH=. .venv/bin/python benchmarks/zones.py``.

Two emulated clusters: a "train" network namespace holding the publisher (it also hosts the
store) and a "rollout" namespace holding 4 subscribers (the rollout replicas, one layout, staged),
joined by one veth pair shaped with ``tc ... tbf rate <--rate>`` on both ends (this kernel has no
netem: no added delay). Inside each namespace processes talk over its own loopback, so the link
carries only what crosses between the clusters. Every process is a worker forked from a preloaded
forkserver that enters its namespace (``setns``) before it opens a socket; all use tcp.

For each of two runs, relays (``Subscriber(zone=Zone("rollout", relay=True))``) and no relays (the
default), version 1 is pulled as a warm-up (connections, plans), then version 2 is measured: the
link's byte counters (``/sys/class/net/<veth>/statistics``, both directions, on the train side)
before and after, and the seconds from the start of ``publish()`` until the last replica returned
from its pull, and each replica's store requests during its pull (calls on wbridge's ``Store``
interface, counted by ``control_plane.CountingStore``; lease refreshes not counted). Each replica
checks every element of its tensors against the version's values; a mismatch aborts the run.
Namespaces are deleted on exit, also after an error.

Last line: ``zones: link_bytes_per_version_vs_model=<x> all_replicas_s=<t> vs_no_relay=<speedup>``
(link bytes of the relay run over the model's bytes; its time; no-relay time over relay time).

``--delta``: deltas across the link. The trainer holds fp32 master weights (normal, std 0.02, as
transformers initialises linear layers) and publishes them cast to bf16
(``register(dtype=torch.bfloat16)``); each version is one ``torch.optim.AdamW`` step at ``--lr``
(default 1e-6) on gradients drawn from a normal distribution, after ``--warmup`` steps (default 8)
that bring Adam's moments to where they are some steps into a run. The bf16 elements that change
per version (printed per version) are then about 1.3-1.5%, as in ``benchmarks/delta.py``'s
training run at lr 1e-6 (1.5%); ``--warmup 0`` measures a run's first steps (4.2% at the first,
falling to 1.8% at the fifth). The 4 replicas are relays. Two runs, relays each: with ``Staging(delta=Delta())``
and without (whole versions). Version 1 is a warm-up (nothing held: whole ranges), versions 2 ..
``--versions`` are measured: link bytes (both directions, store traffic included) and seconds
from ``publish()`` until the last replica returned, per version. Each replica hashes its tensors
and the trainer compares with its own bf16 copy (bit-exact, else the run aborts). Then, in the
delta run, one relay is killed in the middle of its delta pull (its reads stop half-way,
``wbridge.testing.faults``' pause): the others must end bit-exact at that version and pull the
next one as deltas. Last line::

    zones: delta=1 link_bytes_per_version_vs_model=<r> all_replicas_s=<s> vs_full=<x>

(the mean link bytes per measured version of the delta run over the model's bf16 bytes; its median
seconds per version; the whole-version run's median over it).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import stop_all
from transports._util import free_port
from wbridge.testing.workers import Worker

TOKEN = "wbridge-zones-bench"
NET = "10.124.0"
CLONE_NEWNET = 0x40000000
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy", "wbridge"])


def _ip(*args: str, check: bool = True) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


class Link:
    """Two namespaces joined by a shaped veth pair; ``close()`` deletes them (idempotent)."""

    def __init__(self, rate: str) -> None:
        tag = f"wbz{os.getpid()}"
        self.ns = {"train": f"{tag}-t", "rollout": f"{tag}-r"}
        self.dev = {"train": f"{tag}t", "rollout": f"{tag}r"}
        self.addr = {"train": f"{NET}.1", "rollout": f"{NET}.2"}
        try:
            for side in ("train", "rollout"):
                _ip("netns", "add", self.ns[side])
            _ip("link", "add", self.dev["train"], "type", "veth", "peer", "name", self.dev["rollout"])
            for side in ("train", "rollout"):
                ns, dev = self.ns[side], self.dev[side]
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addr[side]}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate]
                subprocess.run([*tc, "burst", "1mb", "latency", "100ms"], check=True, capture_output=True)
        except BaseException:
            self.close()
            raise

    def bytes(self) -> int:
        """Bytes through the link so far (train side, both directions)."""
        ns, dev = self.ns["train"], self.dev["train"]
        cmd = ["ip", "netns", "exec", ns, "cat"]
        paths = [f"/sys/class/net/{dev}/statistics/{d}_bytes" for d in ("tx", "rx")]
        out = subprocess.run(cmd + paths, capture_output=True, text=True, check=True, timeout=20)
        return sum(int(x) for x in out.stdout.split())

    def close(self) -> None:
        for ns in self.ns.values():
            _ip("netns", "del", ns, check=False)


def enter(ns: str) -> None:
    """Moves this process (its calling thread: before any other starts) into namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")
    finally:
        os.close(fd)


def tensors(mb: int, v: int | None) -> dict:
    """8 float32 tensors, ``mb`` MiB in all; version ``v``'s values (None: zeros)."""
    import torch

    from wbridge import Shard

    n = mb * (1 << 20) // 4 // 8
    rows = n // 1024
    out = {}
    for i in range(8):
        t = torch.zeros((rows, 1024), dtype=torch.float32)
        if v is not None:
            fill(t, i, v)
        out[f"w{i}"] = (t, Shard(f"w{i}", (rows, 1024)))
    return out


def fill(t, i: int, v: int) -> None:
    import torch

    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape) % 65521 + (1000 * v + i))


class Trainer:
    def __init__(self, ns: str, host: str, port: int, mb: int) -> None:
        enter(ns)
        from wbridge import Publisher

        self.t = tensors(mb, 0)
        url = f"tcp://{host}:{port}"
        # the publisher at its defaults: Staging() keeps the checksums relays are checked against
        self.pub = Publisher("z", url, host_store=True, token=TOKEN, transport="tcp", host=host, zone="train")
        self.pub.register(self.t)

    def wait_for(self, n: int) -> int:
        return self.pub.wait_for_subscribers(n, timeout=60)

    def publish(self, v: int) -> float:
        for i, (t, _) in enumerate(self.t.values()):
            fill(t, i, v)
        t0 = time.time()
        self.pub.publish(timeout=120)
        return t0

    def close(self) -> None:
        self.pub.close()


class Replica:
    def __init__(self, ns: str, url: str, mb: int, relay: bool) -> None:
        enter(ns)
        from control_plane import CountingStore

        from wbridge import Subscriber, Zone, open_store

        self.t = tensors(mb, None)
        zone = Zone("rollout", relay=True) if relay else None
        self.store = CountingStore(open_store(url))  # the subscriber closes it
        self.sub = Subscriber("z", self.store, token=TOKEN, transport="tcp", staged=True, zone=zone)
        self.sub.register(self.t)

    def pull(self, v: int) -> dict:
        import torch

        calls = self.store.total()
        got = self.sub.pull(min_version=v, timeout=120)
        calls = self.store.total() - calls
        done = time.time()
        bad = 0
        for i, (t, _) in enumerate(self.t.values()):
            want = torch.empty_like(t)
            fill(want, i, got)
            bad += int((t != want).sum())
        s = self.sub.stats.last
        pub, peers = s.nbytes_from_publishers, s.nbytes_from_peers
        return {"v": got, "t": done, "bad": bad, "pub": pub, "peers": peers, "requests": calls}

    def close(self) -> None:
        self.sub.close()


def run(link: Link, mb: int, relay: bool, replicas: int, quiet: bool) -> tuple[float, int]:
    """(seconds until every replica holds version 2, link bytes of version 2)."""
    port = free_port()
    trainer = Worker("trainer", Trainer, link.ns["train"], link.addr["train"], port, mb, context=CTX, timeout=120)
    url = f"tcp://{link.addr['train']}:{port}"
    subs = [
        Worker(f"replica{i}", Replica, link.ns["rollout"], url, mb, relay, context=CTX, timeout=None)
        for i in range(replicas)
    ]
    try:
        for s in subs:
            s.result(120)
        trainer.call("wait_for", replicas)
        for v in (1, 2):
            for s in subs:
                s.send("pull", v)
            time.sleep(0.5)  # every replica waits on the version's ready key
            before = link.bytes()
            t0 = trainer.call("publish", v, call_timeout=180)
            rs = [s.result(180) for s in subs]
            used = link.bytes() - before
            if any(r["v"] != v or r["bad"] for r in rs):
                raise SystemExit(f"zones: replicas not bit-exact at version {v}: {rs}")
            took = max(r["t"] for r in rs) - t0
            if not quiet:
                print(
                    f"  relay={relay} v{v}: {took:.2f}s link {used / (mb << 20):.2f}x model; from publishers "
                    f"{[r['pub'] >> 20 for r in rs]} MiB, from peers {[r['peers'] >> 20 for r in rs]} MiB, "
                    f"store requests {[r['requests'] for r in rs]}",
                    flush=True,
                )
        return took, used
    finally:
        stop_all([trainer, *subs])  # the replicas first


class Master:
    """A trainer of fp32 masters published as bf16, with deltas or without; one AdamW step per
    version (see the module docstring).

    - ``ns``, ``host``, ``port``: its network namespace, address, and the store's port (it hosts it).
    - ``mb``: the published (bf16) model's size in MiB.
    - ``delta``: publish with ``Staging(delta=Delta())``, else ``Staging()`` (the default).
    - ``lr``, ``warmup``: the step size; optimizer steps taken before version 1.
    """

    def __init__(self, ns: str, host: str, port: int, mb: int, delta: bool, lr: float, warmup: int) -> None:
        enter(ns)
        import torch

        from wbridge import Delta, Publisher, Shard, Staging

        n = mb * (1 << 20) // 2 // 8  # bf16 elements per tensor
        self.gen = torch.Generator().manual_seed(0)
        self.w = {f"w{i}": torch.randn((n // 1024, 1024), generator=self.gen) * 0.02 for i in range(8)}
        self.params = [torch.nn.Parameter(t) for t in self.w.values()]  # the same memory
        self.opt = torch.optim.AdamW(self.params, lr=lr)
        for _ in range(warmup):  # the optimizer's moments as they are some steps into a run
            self.step()
        staging = Staging(delta=Delta()) if delta else Staging()
        self.pub = Publisher(
            "z", f"tcp://{host}:{port}", host_store=True, token=TOKEN, transport="tcp", host=host, staging=staging
        )
        self.pub.register({k: (t, Shard(k, tuple(t.shape))) for k, t in self.w.items()}, dtype=torch.bfloat16)

    def shapes(self) -> dict:
        return {k: tuple(t.shape) for k, t in self.w.items()}

    def wait_for(self, n: int) -> int:
        return self.pub.wait_for_subscribers(n, timeout=60)

    def step(self) -> None:
        """One AdamW step on gradients drawn from a standard normal distribution."""
        import torch

        for p in self.params:
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.opt.step()

    def publish(self, v: int) -> tuple[float, str, float]:
        """Steps (from version 2 on) and publishes ``v``: (start time, digest, changed fraction)."""
        import torch

        before = [t.to(torch.bfloat16) for t in self.w.values()]
        if v > 1:
            self.step()
        now = [t.to(torch.bfloat16) for t in self.w.values()]
        changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(before, now))
        t0 = time.time()
        got = self.pub.publish(timeout=120)
        if got != v:
            raise RuntimeError(f"published version {got}, not {v}")
        return t0, digest(now), changed / sum(t.numel() for t in now)

    def close(self) -> None:
        self.pub.close()


def digest(tensors: list) -> str:
    """A hash of the tensors' bytes (the checksum module's: xxh3 where installed)."""
    import torch

    from wbridge.protocol.checksum import hash_bytes

    return ",".join(f"{hash_bytes(t.reshape(-1).view(torch.uint8).numpy()):x}" for t in tensors)


class Relay:
    """A relay replica of bf16 tensors.

    - ``ns``, ``url``: its network namespace and the store's URL.
    - ``shapes``: the trainer's tensors' shapes, by name.
    - ``pause``: None, or a file: once it is gone its reads stop half-way
      (``wbridge.testing.faults``' pause), a line then appended to ``pause + ".hit"``.
    """

    def __init__(self, ns: str, url: str, shapes: dict, pause: str | None) -> None:
        enter(ns)
        import torch

        from wbridge import Shard, Subscriber, Zone

        self.t = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shapes.items()}
        zone = Zone("rollout", relay=True)
        self.sub = Subscriber("z", url, token=TOKEN, transport="tcp", staged=True, zone=zone, lease_ttl=2.0)
        if pause is not None:
            from wbridge.testing.faults import inject, wrapper

            hold = {"signal_path": pause + ".hit", "release_path": pause, "on_reads": range(1, 1 << 20)}
            inject(self.sub, wrapper("pause", **hold))
        self.sub.register({k: (t, Shard(k, tuple(t.shape))) for k, t in self.t.items()})

    def pull(self, v: int) -> dict:
        got = self.sub.pull(min_version=v, timeout=120)
        done = time.time()
        s = self.sub.stats.last
        return {
            "v": got,
            "t": done,
            "digest": digest(list(self.t.values())),
            "delta": s.delta,
            "pub": s.nbytes_from_publishers,
            "peers": s.nbytes_from_peers,
        }

    def close(self) -> None:
        self.sub.close()


def run_delta(link: Link, args: argparse.Namespace, delta: bool, kill: bool) -> tuple[list[float], list[int]]:
    """Seconds and link bytes of each measured version (2 .. ``--versions``); with ``kill``, then
    one relay killed mid-version and one more version without it."""
    port = free_port()
    host = link.addr["train"]
    trainer = Worker(
        "trainer", Master, link.ns["train"], host, port, args.mb, delta, args.lr, args.warmup, context=CTX, timeout=300
    )
    url = f"tcp://{host}:{port}"
    tmp = tempfile.mkdtemp(prefix="wbz-")
    pause = os.path.join(tmp, "release")
    open(pause, "w").close()  # reads pass while the file exists
    subs = []
    try:
        shapes = trainer.call("shapes")
        for i in range(args.replicas):
            victim = kill and i == 0
            subs.append(
                Worker(
                    f"relay{i}",
                    Relay,
                    link.ns["rollout"],
                    url,
                    shapes,
                    pause if victim else None,
                    context=CTX,
                    timeout=None,
                )
            )
        for s in subs:
            s.result(120)
        trainer.call("wait_for", args.replicas)
        took, used = [], []

        def version(v: int, workers: list, victim: Worker | None = None) -> tuple[float, int, list[dict]]:
            for s in workers:
                s.send("pull", v)
            time.sleep(0.5)  # every replica waits on the version's ready key
            before = link.bytes()
            t0, want, changed = trainer.call("publish", v, call_timeout=180)
            if victim is not None:
                deadline = time.monotonic() + 60
                while not os.path.exists(pause + ".hit") and time.monotonic() < deadline:
                    time.sleep(0.005)
                if not os.path.exists(pause + ".hit"):
                    raise SystemExit(f"zones: the relay to kill never began version {v}")
                victim.kill()
            rs = [s.result(180) for s in workers if s is not victim]
            n = link.bytes() - before
            if any(r["v"] != v or r["digest"] != want for r in rs):
                raise SystemExit(f"zones: replicas not bit-exact at version {v}: {[r['v'] for r in rs]}")
            t = max(r["t"] for r in rs) - t0
            if not args.quiet:
                print(
                    f"  delta={int(delta)} v{v}: changed {changed:.4f} {t:.2f}s link {n / (args.mb << 20):.4f}x "
                    f"model; deltas {[int(r['delta']) for r in rs]} from publishers "
                    f"{[round(r['pub'] / (1 << 20), 2) for r in rs]} MiB, from peers "
                    f"{[round(r['peers'] / (1 << 20), 1) for r in rs]} MiB",
                    flush=True,
                )
            return t, n, rs

        for v in range(1, args.versions + 1):
            t, n, _ = version(v, subs)
            if v > 1:
                took.append(t)
                used.append(n)
        if kill:
            v = args.versions + 1
            os.unlink(pause)  # the victim's next read stops half-way
            t, n, rs = version(v, subs, victim=subs[0])
            t2, n2, rs2 = version(v + 1, subs[1:])
            if not all(r["delta"] for r in rs2):
                raise SystemExit("zones: the relays left did not pull deltas after the kill")
            killed = (
                f"  relay killed mid-version {v}: {len(rs)} relays bit-exact in {t:.2f}s, link "
                f"{n / (args.mb << 20):.4f}x model; version {v + 1} without it: {t2:.2f}s, "
                f"link {n2 / (args.mb << 20):.4f}x, deltas"
            )
            if not args.quiet:
                print(killed, flush=True)
        return took, used
    finally:
        stop_all([trainer, *subs])  # the replicas first
        for f in (pause, pause + ".hit"):
            if os.path.exists(f):
                os.unlink(f)
        os.rmdir(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zones", description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="model size in MiB (default 128; bf16 with --delta)")
    ap.add_argument("--rate", default="1gbit", help="link rate for tc tbf (default 1gbit)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--delta", action="store_true", help="deltas across the link (see the module docstring)")
    ap.add_argument("--lr", type=float, default=1e-6, help="--delta: the step size (default 1e-6)")
    ap.add_argument("--versions", type=int, default=6, help="--delta: versions published per run (default 6)")
    ap.add_argument("--warmup", type=int, default=8, help="--delta: optimizer steps before version 1 (default 8)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("zones: needs root (network namespaces)", file=sys.stderr)
        return 2
    link = Link(args.rate)
    if args.delta:
        try:
            took, used = run_delta(link, args, True, kill=True)
            full, _ = run_delta(link, args, False, kill=False)
        finally:
            link.close()
        ratio = statistics.fmean(used) / (args.mb << 20)
        t = statistics.median(took)
        print(
            f"zones: delta=1 link_bytes_per_version_vs_model={ratio:.4f} all_replicas_s={t:.2f} "
            f"vs_full={statistics.median(full) / t:.2f}"
        )
        return 0
    try:
        t_relay, used = run(link, args.mb, True, args.replicas, args.quiet)
        t_plain, _ = run(link, args.mb, False, args.replicas, args.quiet)
    finally:
        link.close()
    ratio, speedup = used / (args.mb << 20), t_plain / t_relay
    print(f"zones: link_bytes_per_version_vs_model={ratio:.2f} all_replicas_s={t_relay:.2f} vs_no_relay={speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
