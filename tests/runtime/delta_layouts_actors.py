"""Processes of the mixed-layout delta test: two publisher ranks that each hold half of every
tensor's rows, and subscribers of three layouts (whole tensors, a row slice, column halves), all
of a channel whose every version changes about 3% of the bf16 elements (as an RL step at lr 1e-6
does). Every process replays the same steps on the whole model (``model_at``) to know what a
version holds."""

from __future__ import annotations

from typing import Any

from wbridge import Publisher, Shard, Subscriber

from .actors import TOKEN
from .delta_actors import Link, expected

FRAC = 0.03  # bf16 elements changed per version
CHANNEL = "mixed"


def model_at(v: int) -> dict[str, Any]:
    """The whole model at version ``v`` (version 1: the initial weights; each later one changes
    ``FRAC`` of the elements, seeded by its number): a copy of it, from ``expected``'s replay."""
    return expected([(u, FRAC) for u in range(2, v + 1)])


def _half(n: int, i: int) -> tuple[int, int]:
    """Offset and size of half ``i`` of ``n``."""
    lo = n // 2 if i else 0
    return lo, (n - n // 2 if i else n // 2)


def boxes(kind: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per tensor the (offsets, sizes) of a layout: ``whole``; ``rows`` (the middle half of the
    rows: both publisher ranks hold part of it); ``rank0``/``rank1`` (a publisher rank's half of
    the rows); ``cols0``/``cols1`` (a half of the columns, of the rows for 1-D tensors)."""
    out = {}
    for name, shape in shapes.items():
        off, size = [0] * len(shape), list(shape)
        if kind == "rows":
            off[0], size[0] = shape[0] // 4, shape[0] // 2
        elif kind.startswith("rank"):
            off[0], size[0] = _half(shape[0], int(kind[-1]))
        elif kind.startswith("cols"):
            d = len(shape) - 1
            off[d], size[d] = _half(shape[d], int(kind[-1]))
        out[name] = (tuple(off), tuple(size))
    return out


def _slice(full: Any, off: tuple[int, ...], size: tuple[int, ...]) -> Any:
    return full[tuple(slice(o, o + s) for o, s in zip(off, size))]


class MixedPub:
    """Publisher rank ``rank`` of 2: the half of every tensor's rows that ``boxes("rank<r>")`` says."""

    def __init__(self, url: str, rank: int, **kwargs: Any) -> None:
        full = model_at(1)
        self.shapes = {n: tuple(t.shape) for n, t in full.items()}
        self.boxes = boxes(f"rank{rank}", self.shapes)
        self.tensors = {}
        for name, (off, size) in self.boxes.items():
            t = _slice(full[name], off, size).contiguous()
            self.tensors[name] = (t, Shard(name, self.shapes[name], off))
        self.pub = Publisher(CHANNEL, url, token=TOKEN, rank=rank, world_size=2, **kwargs)
        self.pub.register(self.tensors)

    def publish(self, v: int, timeout: float = 60.0) -> int:
        """Holds version ``v`` (``model_at(v)``), then publishes it."""
        if v > 1:
            full = model_at(v)
            for name, (t, _) in self.tensors.items():
                t.copy_(_slice(full[name], *self.boxes[name]))
        return self.pub.publish(timeout=timeout)

    def close(self) -> None:
        self.pub.close()


class MixedSub:
    """A subscriber of layout ``kind`` (``boxes``) over a ``link_gbps`` link, tensors filled with
    garbage first."""

    def __init__(self, url: str, kind: str, link_gbps: float | None, **kwargs: Any) -> None:
        import torch

        from wbridge.testing.faults import inject

        shapes = {n: tuple(t.shape) for n, t in model_at(1).items()}
        self.boxes = boxes(kind, shapes)
        self.tensors = {}
        for name, (off, size) in self.boxes.items():
            t = torch.empty(size, dtype=torch.bfloat16)
            t.view(torch.uint8).fill_(0x5A)
            self.tensors[name] = (t, Shard(name, shapes[name], off))
        self.sub = Subscriber(CHANNEL, url, token=TOKEN, **kwargs)
        if link_gbps is not None:
            inject(self.sub, lambda t: Link(t, link_gbps))
        self.sub.register(self.tensors)

    def pull(self, v: int, timeout: float = 60.0) -> dict:
        """Pulls version ``v`` (at least); says how, and whether every byte is ``v``'s."""
        import torch

        got = self.sub.pull(min_version=v, timeout=timeout)
        last = self.sub.stats.last
        full = model_at(got)
        bad = []
        for name, (t, _) in self.tensors.items():
            want = _slice(full[name], *self.boxes[name]).contiguous()
            if not torch.equal(t.view(torch.uint8), want.view(torch.uint8)):
                bad.append(name)
        out = {"v": got, "delta": last.delta, "why": last.delta_reason, "nbytes": last.nbytes, "bad": bad}
        return {**out, "repaired": last.repaired, "full": sum(int(t.numel()) * 2 for t, _ in self.tensors.values())}

    def sub_id(self) -> int | None:
        return self.sub.id

    def close(self) -> None:
        self.sub.close()
