"""What default checksums cost: the trainer's stall with and without them, and ``verify()`` against a pull.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/verify.py [--size 256m] [--transports tcp,local]
[--versions 10]``.

The trainer (this process) publishes a synthetic bf16 model (``--size``: 256 MiB by default,
``_common.model_config``) on two channels side by side, alternating which goes first: one with
``Staging()`` (chunk checksums, the default since they make every version checkable) and one with
``Staging(checksums=False)``. Per transport of ``--transports`` one subscriber process per channel
pulls every version as soon as it is published (TP=1, every byte), and the checksummed channel's
subscriber then calls ``Subscriber.verify()``, which hashes every byte it holds against the
publishers' checksums of that version.

Printed (stdout)::

    verify: transport=<t> stall_with_vs_without=<x> seal_s=<s> pull_s=<s> verify_s=<s> verify_vs_pull=<r> model_mib=<n>

* ``stall_with_vs_without``: the median ``PublishStats.stall_s`` (the snapshot copy: the time the
  trainer's tensors are busy) of the checksummed publisher over the other's, over ``--versions``
  publishes after the first. The checksums are computed after the copy, from the staging slot, so
  they stay out of the stall (target <= 1.05).
* ``seal_s``: the median time of that work after the copy (``PublishStats.delta_s``: checksums,
  and deltas where enabled): ``publish()`` returns that much later, ``publish_async()`` overlaps it.
* ``pull_s``, ``verify_s``, ``verify_vs_pull``: the medians of the checksummed subscriber's pull and of
  its ``verify()`` call, and their ratio (target <= 0.25).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any

from _common import MODEL_SIZES, TOKEN, free_port, model_config, start_actors, stop_all

from wbridge import Staging


class VerifySub:
    """A subscriber process of ``channel``: the whole model (TP=1), pulled and, if asked, verified."""

    def __init__(self, url: str, channel: str, size: str, transport: str) -> None:
        from wbridge import Subscriber
        from wbridge.testing.synthetic import make_tensors

        self.tensors = make_tensors(model_config(size), 1, 0, fused=False)
        self.sub = Subscriber(channel, url, token=TOKEN, transport=transport)
        self.sub.register(self.tensors)

    def pull(self, v: int, verify: bool) -> dict:
        from wbridge.testing.synthetic import mismatches

        got = self.sub.pull(min_version=v, timeout=120.0)
        out: dict[str, Any] = {"v": got, "pull_s": self.sub.stats.last.seconds, "bad": mismatches(self.tensors, got)}
        if verify:
            t0 = time.perf_counter()
            self.sub.verify(timeout=120.0)
            out["verify_s"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.sub.close()


def run(transport: str, args: argparse.Namespace) -> dict:
    from wbridge import Publisher, open_store
    from wbridge.testing.synthetic import make_tensors, set_version

    url = f"tcp://127.0.0.1:{free_port()}"
    tensors = make_tensors(model_config(args.size), 1, 0, fused=False, version=None)
    common = dict(token=TOKEN, transport=[transport], mode="one_step_off")
    rows = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(open_store(url, host_store=True))  # hosted by neither publisher: alike stalls
        pubs = {
            "sums": stack.enter_context(Publisher("sums", url, staging=Staging(), **common)),
            "plain": stack.enter_context(Publisher("plain", url, staging=Staging(checksums=False), **common)),
        }
        for pub in pubs.values():
            pub.register(tensors)
        actors = start_actors([(f"sub-{c}", VerifySub, (url, c, args.size, transport), {}) for c in pubs])
        stack.callback(stop_all, actors)
        for step in range(args.versions + 1):
            set_version(tensors, step + 1)
            row: dict[str, float] = {}
            for c in ["sums", "plain"] if step % 2 else ["plain", "sums"]:
                v = pubs[c].publish(timeout=120.0)
                st = pubs[c].stats.last
                row[f"{c}_stall"], row[f"{c}_seal"] = st.stall_s, st.delta_s
                got = actors[list(pubs).index(c)].call("pull", v, c == "sums", call_timeout=300.0)
                if got["v"] != v or got["bad"]:
                    raise SystemExit(f"verify benchmark: the {c} subscriber does not hold version {v} bit for bit")
                row[f"{c}_pull"] = got["pull_s"]
                if c == "sums":
                    row["verify"] = got["verify_s"]
            rows.append(row)
    after = rows[1:]
    med = statistics.median
    pull_s, verify_s = med(r["sums_pull"] for r in after), med(r["verify"] for r in after)
    return {
        "transport": transport,
        "stall_ratio": med(r["sums_stall"] for r in after) / med(r["plain_stall"] for r in after),
        "seal_s": med(r["sums_seal"] for r in after),
        "pull_s": pull_s,
        "verify_s": verify_s,
        "verify_vs_pull": verify_s / pull_s,
        "model_mib": model_config(args.size).nbytes / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=MODEL_SIZES, default="256m", help="the synthetic model (256m: 256 MiB)")
    p.add_argument("--transports", default="tcp,local", help="comma-separated transports to pull over")
    p.add_argument("--versions", type=int, default=10, help="publishes per channel after the first")
    args = p.parse_args(argv)
    for transport in args.transports.split(","):
        r = run(transport, args)
        fields = dict(
            transport=r["transport"],
            stall_with_vs_without=f"{r['stall_ratio']:.2f}",
            seal_s=f"{r['seal_s']:.4f}",
            pull_s=f"{r['pull_s']:.4f}",
            verify_s=f"{r['verify_s']:.4f}",
            verify_vs_pull=f"{r['verify_vs_pull']:.2f}",
            model_mib=f"{r['model_mib']:.0f}",
        )
        print("verify: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
