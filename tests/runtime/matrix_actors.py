"""Processes of the option matrix test (``test_option_matrix``): one holds the publisher ranks of
every combination, one its subscribers; each combination is a channel of its own.

The publishers' canonical tensors are fp32 masters (``master``); what a reader must hold is
computed here by plain tensor slicing of them, with the cast applied (``.to(torch.bfloat16)``, or
``fp8_reference``: the fp8_block128 format computed block by block from its definition), never
through the planner or the publisher's snapshot code (``expected``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from wbridge import Publisher, Shard, Subscriber, WBridgeError, Zone
from wbridge.testing.gpu_check_data import fp8_reference

TOKEN = "matrix-token"
WORLD = 2  # publisher ranks: rank 0 holds a.weight, bias and b.weight's first 128 rows; rank 1 the rest
SHAPES = {"a.weight": (300, 200), "b.weight": (256, 384), "bias": (48,)}  # a: partial fp8 edge blocks
WEIGHTS = ("a.weight", "b.weight")  # what fp8_block128 transforms (bias stays as it is)
SPLIT = 128  # b.weight's rows split between the ranks (on a 128 block edge, as fp8_block128 needs)
# the reader layouts: a box of each canonical tensor, (row range, column range) of the 2-D ones
LAYOUTS = {
    "whole": {},
    "rows": {"a.weight": ((70, 230), None), "b.weight": ((100, 200), None), "bias": ((10, 40), None)},
    "cols": {"a.weight": (None, (50, 170)), "b.weight": (None, (100, 300))},
}
BLOCK = 128


def master(v: int) -> dict[str, torch.Tensor]:
    """The publishers' canonical fp32 tensors at version ``v``: fixed random values of which about
    one in eleven changes from one version to the next (so deltas have something to skip), with
    magnitudes spread over decades row by row (fp8 blocks get different scales)."""
    out = {}
    for k, (name, shape) in enumerate(SHAPES.items()):
        base = torch.Generator().manual_seed(1000 + k)
        t = torch.randn(shape, generator=base) * torch.exp(
            torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=base) * 3
        )
        flat = t.view(-1)
        moved = torch.arange(flat.numel()) % 11 == v % 11
        new = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(7919 * v + k))
        flat[moved] = new[moved]
        out[name] = t
    return out


def _box(name: str, layout: str) -> tuple[slice, ...]:
    """The slices of canonical ``name`` (a weight, its ``_scale_inv`` or the bias) a reader of
    ``layout`` holds."""
    weight = name.removesuffix("_scale_inv")
    rows, cols = LAYOUTS[layout].get(weight, (None, None))
    scale = name != weight

    def cut(span: tuple[int, int] | None) -> slice:
        if span is None:
            return slice(None)
        lo, hi = span
        return slice(lo // BLOCK, math.ceil(hi / BLOCK)) if scale else slice(lo, hi)

    return (cut(rows),) if len(SHAPES[weight]) == 1 else (cut(rows), cut(cols))


def expected(v: int, cast: str, layout: str) -> dict[str, torch.Tensor]:
    """What a reader of ``layout`` holds at version ``v`` of publishers casting as ``cast``."""
    full: dict[str, torch.Tensor] = {}
    for name, t in master(v).items():
        if cast == "fp8" and name in WEIGHTS:
            full[name], full[name + "_scale_inv"] = fp8_reference(t)
        elif cast == "bf16":
            full[name] = t.to(torch.bfloat16)
        else:
            full[name] = t
    return {name: t[_box(name, layout)].clone() for name, t in full.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class MatrixPubs:
    """The publisher ranks of every combination, ``WORLD`` per channel, in this process.

    - ``url``: the store's URL.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.pubs: dict[str, list[tuple[Publisher, dict[str, torch.Tensor]]]] = {}

    def _mine(self, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if rank == 0:
            return {"a.weight": full["a.weight"], "b.weight": full["b.weight"][:SPLIT], "bias": full["bias"]}
        return {"b.weight": full["b.weight"][SPLIT:]}

    def open(self, channel: str, transport: str, staging: Any, mode: Any, cast: str) -> str | None:
        """Publishers of ``channel``, registered; None, or where and why they were refused
        (``"register: UsageError: ..."``)."""
        ranks = []
        try:
            for rank in range(WORLD):
                what = "construction"
                pub = Publisher(
                    channel,
                    self.url,
                    rank=rank,
                    world_size=WORLD,
                    token=TOKEN,
                    transport=[transport],
                    mode=mode,
                    staging=staging,
                )
                tensors = {n: t.clone() for n, t in self._mine(rank, master(0)).items()}
                ranks.append((pub, tensors))
                offsets = {"a.weight": (0, 0), "b.weight": (SPLIT * rank, 0), "bias": (0,)}
                decls = {n: (t, Shard(n, SHAPES[n], offsets[n])) for n, t in tensors.items()}
                what = "register"
                pub.register(
                    decls,
                    dtype=torch.bfloat16 if cast == "bf16" else None,
                    transforms={n: "fp8_block128" for n in tensors if n in WEIGHTS} if cast == "fp8" else None,
                )
        except WBridgeError as e:
            for pub, _ in ranks:
                pub.close()
            return f"{what}: {type(e).__name__}: {e}"
        self.pubs[channel] = ranks
        return None

    def publish(self, channel: str, v: int, timeout: float = 30.0) -> list[Any]:
        """Every rank publishes version ``v``'s values at once (a collective): the versions, or
        the errors' text."""
        out: list[Any] = [None] * WORLD

        def one(rank: int) -> None:
            pub, tensors = self.pubs[channel][rank]
            for n, t in self._mine(rank, master(v)).items():
                tensors[n].copy_(t)
            try:
                out[rank] = pub.publish(timeout=timeout)
            except WBridgeError as e:
                out[rank] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=one, args=(r,)) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def close(self, channel: str) -> None:
        for pub, _ in self.pubs.pop(channel, []):
            pub.close()


class MatrixSubs:
    """The readers of every combination (and a zone reader's relay), in this process.

    - ``url``: the store's URL.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.subs: dict[str, list[tuple[str, Subscriber, dict[str, torch.Tensor], str]]] = {}
        self.cast: dict[str, str] = {}

    def _tensors(self, cast: str, layout: str) -> dict[str, torch.Tensor]:
        """The reader's tensors (NaN or 0xFF bytes: nothing of any version), shaped as ``expected``."""
        out = {}
        for name, t in expected(0, cast, layout).items():
            out[name] = torch.empty_like(t)
            _bits(out[name]).fill_(0xFF)
        return out

    def open(self, channel: str, transport: str, reader: str, layout: str, cast: str) -> str | None:
        """The readers of ``channel``: the reader of kind ``reader`` (and for ``zone`` its relay,
        of the whole layout, first), registered; None, or where and why they were refused."""
        zone = f"z-{channel}"
        kinds = {
            "plain": {},
            "staged": {"staged": True},
            "verify": {"verify": True},
            "zone": {"zone": Zone(zone)},
            "relay": {"zone": Zone(zone, relay=True)},
        }
        plan = ([("relay", kinds["relay"], "whole")] if reader == "zone" else []) + [(reader, kinds[reader], layout)]
        subs = []
        try:
            for role, kwargs, lay in plan:
                what = "construction"
                sub = Subscriber(
                    channel, self.url, token=TOKEN, transport=transport, name=f"{channel}-{role}", **kwargs
                )
                tensors = self._tensors(cast, lay)
                subs.append((role, sub, tensors, lay))
                what = "register"
                sub.register({n: (t, Shard(n, _global(n), _offsets(n, lay))) for n, t in tensors.items()})
        except WBridgeError as e:
            for _, sub, _, _ in subs:
                sub.close()
            return f"{what}: {type(e).__name__}: {e}"
        self.subs[channel], self.cast[channel] = subs, cast
        return None

    def pull(self, channel: str, v: int, timeout: float = 30.0) -> list[dict]:
        """Each reader of ``channel`` pulls version ``v`` (a zone reader's relay first) and is
        compared bit for bit with ``expected``: per reader, its role, the version, the tensors that
        differ, its stats; or the error it raised."""
        out = []
        for role, sub, tensors, layout in self.subs[channel]:
            try:
                got = sub.pull(min_version=v, timeout=timeout)
            except WBridgeError as e:
                out.append({"role": role, "error": type(e).__name__, "message": str(e)})
                continue
            want = expected(got, self.cast[channel], layout)
            bad = [n for n, t in tensors.items() if not torch.equal(_bits(t), _bits(want[n]))]
            last = sub.stats.last
            out.append(
                {
                    "role": role,
                    "v": got,
                    "bad": bad,
                    "nbytes": last.nbytes,
                    "from_peers": last.nbytes_from_peers,
                }
            )
        return out

    def close(self, channel: str) -> None:
        for _, sub, _, _ in self.subs.pop(channel, []):
            sub.close()


def _global(name: str) -> tuple[int, ...]:
    weight = name.removesuffix("_scale_inv")
    shape = SHAPES[weight]
    return shape if name == weight else tuple(math.ceil(n / BLOCK) for n in shape)


def _offsets(name: str, layout: str) -> tuple[int, ...]:
    return tuple(s.start or 0 for s in _box(name, layout))
