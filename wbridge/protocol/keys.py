"""Store keys of a channel: the one place that names what lives where in the store.

Layout of a channel ``c`` (all records sealed with the token, see ``records``)::

    wb/c/reg                    registration counter; epoch = (count - 1) // world_size + 1
    wb/c/e/<e>/r/<rank>         publisher rank record: layout, world size, host, served transports
    wb/c/e/<e>/r/<rank>/packed/<g>  slot layout of packing generation g of that rank
    wb/c/version                the newest committed version's record (v, epoch, slot, fence)
    wb/c/v/<v>/e/<e>/snap       how many publisher ranks of epoch e snapshotted v; the last commits
    wb/c/v/<v>/sum/<rank>       per-rank chunk checksums of v (when enabled)
    wb/c/v/<v>/pack/<rank>      the packing generation of rank's slot holding v (staged modes)
    wb/c/layout/<hash>          a subscriber layout, announced once per distinct layout
    wb/c/slot/<s>/fence         bumped by every rank before it overwrites slot s
    wb/c/subs                   subscriber counter; subscriber ids are 1, 2, ...
    wb/c/sub/<i>                subscriber record;  .../live lease, .../acked, .../reading
"""

from __future__ import annotations

from ..errors import UsageError


class Keys:
    def __init__(self, channel: str) -> None:
        if not channel or "/" in channel:
            raise UsageError(f"channel name {channel!r} must be non-empty and contain no '/'")
        self.p = f"wb/{channel}/"

    reg = property(lambda self: self.p + "reg")
    version = property(lambda self: self.p + "version")
    subs = property(lambda self: self.p + "subs")

    def rank(self, epoch: int, rank: int) -> str:
        return f"{self.p}e/{epoch}/r/{rank}"

    def snap(self, v: int, epoch: int) -> str:
        # per epoch: ranks that died half-way through publishing v must not count toward the
        # commit of the v that their restarted selves publish in the next epoch
        return f"{self.p}v/{v}/e/{epoch}/snap"

    def sums(self, v: int, rank: int) -> str:
        return f"{self.p}v/{v}/sum/{rank}"

    def packed(self, epoch: int, rank: int, gen: int) -> str:
        return f"{self.rank(epoch, rank)}/packed/{gen}"

    def packing(self, v: int, rank: int) -> str:
        return f"{self.p}v/{v}/pack/{rank}"

    def reader_layout(self, h: str) -> str:
        return f"{self.p}layout/{h}"

    def fence(self, slot: int) -> str:
        return f"{self.p}slot/{slot}/fence"

    def sub(self, i: int, what: str = "") -> str:
        return f"{self.p}sub/{i}" + (f"/{what}" if what else "")
