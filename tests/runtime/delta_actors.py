"""Publisher and subscriber processes for the delta tests: a publisher whose steps change a small
fraction of the elements (as RL fine-tuning does), and subscribers that check what they hold
against the same steps replayed locally (``expected``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wbridge import Publisher, Subscriber
from wbridge.testing.faults import Delegating
from wbridge.testing.synthetic import make_tensors

from .actors import TOKEN, model


def perturb(tensors: dict[str, tuple[Any, Any]], seed: int, frac: float) -> None:
    """Rewrites about ``frac`` of every tensor's elements with new values, deterministically."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _, (t, _) in sorted(tensors.items()):
        flat = t.view(-1)
        mask = torch.rand(flat.shape, generator=gen) < frac
        k = int(mask.sum())
        if flat.dtype.is_floating_point:
            new = torch.randn(k, generator=gen)
        else:
            new = torch.randint(0, 256, (k,), generator=gen)
        flat[mask] = new.to(flat.dtype)


ODD = "odd.bytes"  # a uint8 tensor of odd length last: the slot ends on an odd byte


def tensors_of(tp: int, rank: int, odd: bool, **kwargs: Any) -> dict[str, tuple[Any, Any]]:
    import torch

    from wbridge import Shard

    tensors = make_tensors(model(), tp, rank, fused=False, **kwargs)
    if odd:
        t = torch.arange(1001, dtype=torch.int32).to(torch.uint8)
        if kwargs.get("fill_value") is not None:
            t.fill_(kwargs["fill_value"])
        tensors[ODD] = (t, Shard(ODD, (1001,)))
    return tensors


_replayed: dict[bool, tuple[tuple, dict]] = {}  # odd -> (steps, tensors): the last replay, to go on from


def expected(steps: Sequence[tuple[int, float]], odd: bool = False) -> dict[str, Any]:
    """The publisher's full tensors after ``steps`` ((seed, frac) each, in order): a copy of them.
    A process checks version after version, so it goes on from its last replay where ``steps``
    extends it instead of replaying every step again."""
    steps = tuple(steps)
    done, tensors = _replayed.get(odd, ((), None))
    if tensors is None or steps[: len(done)] != done:
        done, tensors = (), tensors_of(1, 0, odd, version=0)
    for seed, frac in steps[len(done) :]:
        perturb(tensors, seed, frac)
    _replayed[odd] = (steps, tensors)
    return {name: t.clone() for name, (t, _) in tensors.items()}


class DeltaPub:
    def __init__(self, url: str, *, host_store: bool = True, odd: bool = False, **kwargs: Any) -> None:
        self.tensors = tensors_of(1, 0, odd, version=0)
        self.pub = Publisher("d", url, host_store=host_store, token=TOKEN, **kwargs)
        self.pub.register(self.tensors)

    def step(self, seed: int, frac: float, timeout: float = 30.0) -> int:
        """One training step that changes ``frac`` of the elements, then ``publish``."""
        perturb(self.tensors, seed, frac)
        return self.pub.publish(timeout=timeout)

    def publish(self, timeout: float = 30.0) -> int:
        return self.pub.publish(timeout=timeout)

    def register_again(self) -> None:
        """Registers the same tensors again: a new publisher epoch."""
        self.pub.register(self.tensors)

    def stats(self) -> dict:
        st = self.pub.stats.last
        return {"stall_s": st.stall_s, "delta_s": st.delta_s}

    def close(self) -> None:
        self.pub.close()


LINK_GBPS = 0.1  # the emulated link of the delta tests: deltas pay on it, also under CI load (a full pull: ~0.5 s)


class Link(Delegating):
    """A link of ``gbps`` Gbit/s (None: as fast as the transport) and ``latency`` seconds per read:
    every read returns only once its bytes would have crossed it (loopback and shared memory are
    so fast here that a full read beats decoding deltas, and the subscriber rightly chooses full
    pulls there: ``PullStats.delta_reason == "cost"``)."""

    def __init__(self, inner: Any, gbps: float | None, latency: float = 0.0) -> None:
        super().__init__(inner)
        self.rate = gbps * 1e9 / 8 if gbps is not None else float("inf")
        self.latency = latency
        self.reads = 0

    def read(self, prepared: Any, *, timeout: float) -> None:
        import time

        t0 = time.monotonic()
        self.reads += 1
        self.inner.read(prepared[0], timeout=timeout)
        left = self.latency + prepared[2].total_bytes / self.rate - (time.monotonic() - t0)
        if left > 0:
            time.sleep(min(left, timeout))


class DeltaSub:
    """A subscriber of TP rank ``rank`` of ``tp`` (unfused), tensors filled with garbage first,
    reading over a ``LINK_GBPS`` link (``link_gbps=None``: as fast as the transport goes) with
    ``latency`` seconds per read; ``twice``: one tensor registered a second time (its bytes read
    into two destinations)."""

    def __init__(
        self,
        url: str,
        tp: int = 1,
        rank: int = 0,
        fault: tuple[str, dict] | None = None,
        odd: bool = False,
        link_gbps: float | None = LINK_GBPS,
        latency: float = 0.0,
        twice: bool = False,
        **kwargs,
    ) -> None:
        from wbridge.testing.faults import inject, wrapper

        self.odd = odd
        self.tensors = tensors_of(tp, rank, odd, version=None, fill_value=0x5A)
        self.sub = Subscriber("d", url, token=TOKEN, **kwargs)
        wrap = wrapper(fault[0], **fault[1]) if fault is not None else (lambda t: t)
        self.links: list[Link] = []
        if link_gbps is not None or latency:
            inject(self.sub, lambda t: self.links.append(Link(wrap(t), link_gbps, latency)) or self.links[-1])
        elif fault is not None:
            inject(self.sub, wrap)
        registered = dict(self.tensors)
        if twice:
            name, (t, decl) = sorted(self.tensors.items())[0]
            registered[name + ".again"] = (t.clone(), decl)
        self.sub.register(registered)

    def pull(self, min_version: int | None = None, timeout: float = 60.0) -> dict:
        before = sum(link.reads for link in self.links)
        v = self.sub.pull(min_version=min_version, timeout=timeout)
        last = self.sub.stats.last
        out = {"v": v, "delta": last.delta, "nbytes": last.nbytes, "repaired": last.repaired}
        out["why"] = last.delta_reason
        out["link_reads"] = sum(link.reads for link in self.links) - before  # (reads over the link, stamps too)
        return {**out, "retries": last.retries}

    def bad(self, steps: Sequence[tuple[int, float]]) -> list[str]:
        """Names of tensors that differ from the publisher's after ``steps`` (in this rank's box)."""
        import torch

        full = expected(steps, self.odd)
        out = []
        for name, (t, decl) in self.tensors.items():
            offs = decl.offsets or (0,) * t.dim()
            want = full[name][tuple(slice(o, o + s) for o, s in zip(offs, t.shape))]
            if not torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8)):
                out.append(name)
        return out

    def sub_id(self) -> int | None:
        return self.sub.id

    def scribble(self, name: str, byte: int = 0x33) -> None:
        """Someone else writes into a registered tensor between pulls."""
        import torch

        t = self.tensors[name][0]
        t.view(-1)[: t.numel() // 3].view(torch.uint8).fill_(byte)

    def close(self) -> None:
        self.sub.close()
