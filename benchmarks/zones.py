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
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import subprocess
import sys
import time

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
        from wbridge import Publisher, Staging

        self.t = tensors(mb, 0)
        url = f"tcp://{host}:{port}"
        # relays are read only where the publishers keep checksums (their bytes are checked)
        self.pub = Publisher(
            "z",
            url,
            host_store=True,
            token=TOKEN,
            transport="tcp",
            host=host,
            zone="train",
            staging=Staging(checksums=True),
        )
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
        for w in (*subs, trainer):
            w.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zones", description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=128, help="model size in MiB (default 128)")
    ap.add_argument("--rate", default="1gbit", help="link rate for tc tbf (default 1gbit)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("zones: needs root (network namespaces)", file=sys.stderr)
        return 2
    link = Link(args.rate)
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
