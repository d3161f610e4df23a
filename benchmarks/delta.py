"""Delta updates on a real training run: bytes a one-version-behind subscriber reads, and their cost.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/delta.py [--lr 1e-6 1e-5] [--transport tcp|local]
[--link 1gbit] [--fp8]``.

The trainer (this process) trains a small transformers Llama (random init: hidden 256, 4 layers,
vocabulary 4096, about 5 M parameters) with fp32 master weights and AdamW at each ``--lr`` for
``--steps`` steps on random tokens, and after the initial weights and after every step publishes
them, cast to bf16 (``register(dtype=torch.bfloat16)``; with ``--fp8`` every 2-D weight as
DeepSeek-style FP8 blocks, ``transforms={name: "fp8_block128"}``, the rest bf16), on two channels
side by side: one
``Publisher(delta=True)`` and one without deltas (the baseline). Per step both publish, then one
subscriber process per channel pulls that version (the order of the channels alternates from step
to step, the same for the publishes and the pulls), so it is always exactly one version behind
when it pulls, and hashes what it holds; the trainer checks that hash against its own bf16 copy
(bit exact, else the run exits non-zero).

With ``--link RATE`` (root: it makes network namespaces; tcp) the trainer, its publishers and the
store are in one network namespace and the subscribers in another, joined by a veth pair shaped
with ``tc ... tbf rate RATE`` on both ends (``zones.Link``; this kernel has no netem, so no added
delay): a link between clusters.

Printed per learning rate, in ``--lr`` order (stdout, one line each; `` link=RATE`` appended with
``--link``, `` fp8`` with ``--fp8``)::

    delta: changed=<f> read_ratio=<r> snapshot_overhead=<x> pull_speedup=<s> bytes_per_changed=<b> encode_gbps=<g>

* ``changed``: the mean fraction of published elements (bf16; with ``--fp8`` FP8, their float32
  scales and the bf16 rest) that differ from the version before (per step).
* ``read_ratio``: bytes the delta subscriber read (``PullStats.nbytes``: headers, tables, entries,
  stamps and any repair) averaged over its pulls after the first, fallbacks included, over the
  bytes of a full pull.
* ``snapshot_overhead``: the delta publisher's median ``stall_s`` over the baseline publisher's
  (the trainer's stall: the snapshot copy and cast), over the ``--steps`` publishes after the
  first (20 by default). The delta encoding and the checksums that
  ``delta=True`` turns on read only the staging slots, so they run after the stall
  (``PublishStats.delta_s``: its median is printed on stderr, with the share of pulls that were
  deltas); ``publish()`` returns that much later, ``publish_async()`` overlaps it.
* ``pull_speedup``: the baseline subscriber's median pull time over the delta subscriber's. The
  delta subscriber chooses per pull between deltas and a full read by what each costs on its link
  (``wbridge.pull.delta.choose``); stderr says how often it chose what (``delta_reason``).
* ``bytes_per_changed``: the bytes the delta subscriber read over its pulls after the first
  (``read_ratio``'s numerator: everything, fallbacks included) over the published elements that
  changed in those versions.
* ``encode_gbps``: the slot's bytes over the publisher's median delta encode (the scan of the two
  staging slots and the coding, ``PublishStats.encode_s``: CPU seconds of the publishing thread,
  one core's time, which a loaded host does not inflate by descheduling; the checksums are not in
  it).

The plot (``delta.png`` in ``--out``, default the current directory) shows per step the changed
fraction and the read ratio for each learning rate; ``delta.json`` there holds every pull (per
step: the changed fraction, each subscriber's bytes, seconds, whether it read a delta and why).

The trainer's threads: this script sets ``OMP_WAIT_POLICY=PASSIVE`` (unless it is set already)
for itself and the subscriber processes, so torch's idle OpenMP threads sleep. By default each
spins for some 10 ms after every parallel op (the baseline publisher's cast into bf16, say), and
here, where trainer and subscribers share two cores, that spin took one of them from the delta
subscriber whenever its pull came right after the baseline's publish: in half the steps, 2.4-9.6 ms
of the trainer's CPU during a 12 ms call of a 4 ms pull (0.6-1.1 ms with the threads asleep). With
``--link`` the two sides stand for hosts in two clusters, whose CPUs such a spin would not share.

Target (a ratio, measured here and not asserted by the tests): over ``--link 1gbit`` at lr 1e-6 the
delta subscriber takes deltas on every pull and ``pull_speedup`` is above 2 (a full version takes
about 80 ms over the link, its deltas a few).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import os
import statistics
import sys
import time
from typing import Any

# Idle OpenMP threads sleep (before torch loads: ``_common`` imports it; the actors inherit it):
# see "The trainer's threads" above.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from _common import TOKEN, free_port, start_actors, stop_all  # noqa: E402
from zones import Link as NetnsLink  # noqa: E402
from zones import enter  # noqa: E402

from wbridge import Delta, Staging  # noqa: E402

HIDDEN, LAYERS, VOCAB = 256, 4, 4096


def build_model(seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).float()


def digest(tensors: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SubActor:
    """A subscriber process: bf16 tensors of every parameter's shape; pulls and hashes them.
    ``net``: (namespace, address) to enter and bind (``--link``), else None (loopback)."""

    def __init__(
        self, url: str, channel: str, shapes: dict[str, tuple[tuple[int, ...], str]], transport: str, net: tuple | None
    ) -> None:
        if net is not None:
            enter(net[0])  # before any socket is opened
        import torch

        from wbridge import Shard, Subscriber

        self.tensors = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, (s, d) in shapes.items()}
        host = net[1] if net is not None else "127.0.0.1"
        self.sub = Subscriber(channel, url, token=TOKEN, transport=transport, host=host)
        self.sub.register({n: (t, Shard(n, tuple(t.shape))) for n, t in self.tensors.items()})

    def pull(self, v: int) -> dict:
        got = self.sub.pull(min_version=v, timeout=60.0)
        last = self.sub.stats.last
        out = {"v": got, "seconds": last.seconds, "nbytes": last.nbytes, "delta": last.delta, "why": last.delta_reason}
        return {**out, "hash": digest(self.tensors)}

    def close(self) -> None:
        self.sub.close()


def published(params: dict[str, Any], fp8: bool) -> dict[str, Any]:
    """What the publishers publish of ``params`` (fp32 masters): bf16, or with ``fp8`` each 2-D
    weight as FP8 blocks and their scales (the snapshot's own quantiser), the rest bf16."""
    import torch

    from wbridge.publish.transforms import SCALE_SUFFIX, Fp8Block128, blocks

    out = {}
    for n, t in params.items():
        if fp8 and t.dim() == 2:
            w = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
            scale = torch.empty(blocks(t.shape[0]), blocks(t.shape[1]), dtype=torch.float32)
            Fp8Block128(w, scale).copy_(t)
            out[n], out[n + SCALE_SUFFIX] = w, scale
        else:
            out[n] = t.to(torch.bfloat16)
    return out


def changed_elements(now: dict[str, Any], prev: dict[str, Any]) -> int:
    """Elements of ``now`` whose bytes differ from ``prev``'s (each in its own dtype)."""
    total = 0
    for n, t in now.items():
        w = t.element_size()
        a = t.reshape(-1).view(torch_int(w))
        total += int((a != prev[n].reshape(-1).view(torch_int(w))).sum())
    return total


def torch_int(size: int) -> Any:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[size]


def run_lr(lr: float, args: argparse.Namespace, link: NetnsLink | None) -> dict:
    """One learning rate's run; with ``link`` this process (the trainer) is in its "train"
    namespace already and the subscribers enter its "rollout" one."""
    import torch

    from wbridge import Publisher, Shard, open_store

    model = build_model(args.seed)
    params = {n: p.data for n, p in model.named_parameters()}
    transforms = {n: "fp8_block128" for n, t in params.items() if args.fp8 and t.dim() == 2}
    prev = published(params, args.fp8)
    shapes = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in prev.items()}
    host = link.addr["train"] if link is not None else "127.0.0.1"
    net = (link.ns["rollout"], link.addr["rollout"]) if link is not None else None
    url = f"tcp://{host}:{free_port()}"
    common = dict(token=TOKEN, transport=args.transport, mode="one_step_off", host=host)
    store = open_store(url, host_store=True)  # hosted by neither publisher: their stalls compare alike
    pubs = {
        "delta": Publisher("delta", url, staging=Staging(delta=Delta()), **common),
        "full": Publisher("full", url, **common),
    }
    actors = []
    try:
        for pub in pubs.values():
            tensors = {n: (t, Shard(n, tuple(t.shape))) for n, t in params.items()}
            pub.register(tensors, dtype=torch.bfloat16, transforms=transforms or None)
        actors = start_actors([(f"sub-{c}", SubActor, (url, c, shapes, args.transport, net), {}) for c in pubs])
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(args.seed + 1)
        rows: list[dict] = []
        for step in range(args.steps + 1):
            changed, nchanged = 0.0, 0
            if step:  # one optimizer step on random tokens
                ids = torch.randint(0, VOCAB, (8, 64), generator=gen)
                loss = model(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                now = published(params, args.fp8)
                nchanged = changed_elements(now, prev)
                changed = nchanged / sum(t.numel() for t in now.values())
                prev = now
            want = digest(prev)
            order = ["delta", "full"] if step % 2 else ["full", "delta"]  # neither always goes first
            row: dict[str, Any] = {"step": step, "changed": changed, "nchanged": nchanged}
            # both publish, then both pull: a publish right after the full subscriber's 80 ms pull
            # is slower (by 0.6 ms of 2 here), and only the delta publisher's would ever follow it
            vs = {}
            for c in order:
                vs[c] = pubs[c].publish(timeout=60.0)
                st = pubs[c].stats.last
                row[f"{c}_stall"], row[f"{c}_encode"], row[f"{c}_scan"] = st.stall_s, st.delta_s, st.encode_s
            for c in order:
                v = vs[c]
                got = actors[list(pubs).index(c)].call("pull", v, call_timeout=120.0)
                if got["hash"] != want or got["v"] != v:
                    raise SystemExit(f"delta benchmark: {c} subscriber does not hold version {v} bit for bit")
                row[f"{c}_pull"], row[f"{c}_bytes"], row[f"{c}_delta"] = got["seconds"], got["nbytes"], got["delta"]
                row[f"{c}_why"] = got["why"]
            rows.append(row)
    finally:
        stop_all(actors)
        for pub in pubs.values():
            pub.close()
        store.close()
    after = rows[1:]
    full_bytes = rows[0]["full_bytes"]
    med = statistics.median
    return {
        "lr": lr,
        "rows": rows,
        "changed": statistics.fmean(r["changed"] for r in after),
        "read_ratio": statistics.fmean(r["delta_bytes"] for r in after) / full_bytes,
        "snapshot_overhead": med(r["delta_stall"] for r in after) / med(r["full_stall"] for r in after),
        "pull_speedup": med(r["full_pull"] for r in after) / med(r["delta_pull"] for r in after),
        "deltas": sum(bool(r["delta_delta"]) for r in after),
        "reasons": dict(collections.Counter(r["delta_why"] for r in after)),
        "pulls": len(after),
        "encode_s": med(r["delta_encode"] for r in after),
        "bytes_per_changed": sum(r["delta_bytes"] for r in after) / max(1, sum(r["nchanged"] for r in after)),
        "encode_gbps": full_bytes / med([r["delta_scan"] for r in after if r["delta_scan"] > 0] or [math.inf]) / 1e9,
        "stall_s": med(r["full_stall"] for r in after),
        "pull_s": (med(r["full_pull"] for r in after), med(r["delta_pull"] for r in after)),
    }


def plot(results: list[dict], out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        steps = [row["step"] for row in r["rows"][1:]]
        full = r["rows"][0]["full_bytes"]
        a.plot(steps, [row["changed"] for row in r["rows"][1:]], marker="o", label=f"lr {r['lr']:g}")
        b.plot(steps, [row["delta_bytes"] / full for row in r["rows"][1:]], marker="o", label=f"lr {r['lr']:g}")
    a.set(xlabel="step", ylabel="bf16 elements changed (fraction)", title="changed per step")
    b.set(xlabel="step", ylabel="delta pull bytes / full pull bytes", title="read ratio per pull")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "delta.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--transport", choices=["tcp", "local"], default="tcp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.getcwd(), help="directory for delta.png (default: the current one)")
    p.add_argument("--quiet", action="store_true", help="only the summary lines")
    p.add_argument("--fp8", action="store_true", help='publish 2-D weights as FP8 blocks (transforms "fp8_block128")')
    p.add_argument(
        "--link",
        default=None,
        help="a tc tbf rate (1gbit): publishers and subscribers in two network namespaces joined by "
        "a veth pair shaped to it (root; tcp)",
    )
    args = p.parse_args(argv)
    if args.link is not None and args.transport != "tcp":
        p.error("--link runs over tcp (the namespaces share no memory transport)")
    link = NetnsLink(args.link) if args.link is not None else None
    try:
        if link is not None:
            enter(link.ns["train"])  # this process is the trainer: its sockets are on the train side
        results = run_all(args, link)
    finally:
        if link is not None:
            link.close()
    path = plot(results, args.out)
    with open(os.path.join(args.out, "delta.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not args.quiet:
        print(f"plot: {path}", file=sys.stderr)
    return 0


def run_all(args: argparse.Namespace, link: NetnsLink | None) -> list[dict]:
    """Every ``--lr`` in turn, each printing its line."""
    suffix = (f" link={args.link}" if args.link is not None else "") + (" fp8" if args.fp8 else "")
    results = []
    for lr in args.lr:
        t0 = time.monotonic()
        r = run_lr(lr, args, link)
        results.append(r)
        if not args.quiet:
            print(
                f"delta[lr={lr:g}, {args.transport}]: {r['deltas']}/{r['pulls']} pulls were deltas "
                f"(why, per pull: {r['reasons']}), all bit-exact; "
                f"median delta_s (encode + checksums) {r['encode_s'] * 1e3:.2f} ms after a "
                f"{r['stall_s'] * 1e3:.2f} ms baseline stall; median pull {r['pull_s'][0] * 1e3:.1f} ms full, "
                f"{r['pull_s'][1] * 1e3:.1f} ms with deltas; "
                f"{time.monotonic() - t0:.0f} s",
                file=sys.stderr,
            )
        print(
            f"delta: changed={r['changed']:.4f} read_ratio={r['read_ratio']:.4f} "
            f"snapshot_overhead={r['snapshot_overhead']:.2f} pull_speedup={r['pull_speedup']:.2f} "
            f"bytes_per_changed={r['bytes_per_changed']:.3f} encode_gbps={r['encode_gbps']:.2f}{suffix}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    sys.exit(main())
