"""Store keys of a channel: the one place that names what lives where in the store.

Layout of a channel ``c`` (all records sealed with the token, see ``records``)::

    wb/c/reg                    registration counter; epoch = (count - 1) // world_size + 1
    wb/c/e/<e>/r/<rank>         publisher rank record: layout, world size, host, served transports
    wb/c/version                the newest committed version's record (v, epoch, slot, fence)
    wb/c/v/<v>/e/<e>/snap       how many publisher ranks of epoch e snapshotted v; the last commits
    wb/c/v/<v>/sum/<rank>       per-rank chunk checksums of v (when enabled)
    wb/c/v/<v>/ready            written once v is committed: subscribers block on it appearing
    wb/c/v/<v>/acked            written once every live subscriber acked v or later
    wb/c/v/<v>/free             written once no live subscriber reads (an older version in) the
                                slot that v is about to overwrite
    wb/c/slot/<s>/fence         bumped by every rank before it overwrites slot s
    wb/c/subs                   subscriber counter; subscriber ids are 1, 2, ...
    wb/c/sub/<i>                subscriber record
    wb/c/sub/<i>/live           its lease
    wb/c/sub/<i>/state          "<acked> <reading>": last version applied, version being read (0: none)

``acked`` and ``free`` are written by the aggregating publisher rank (rank 0), which alone reads
every subscriber's lease and state (one batched read per poll); the other ranks block on those keys
appearing (see ``wbridge._tracker``).

Garbage collection: the committer of v deletes the ``v/<v - lag>/...`` keys (``lag`` = slots + 2,
``version_keys``), and the aggregating publisher rank deletes the three ``sub/<i>`` keys of a
subscriber once its lease lapsed, so the store holds a bounded number of keys however many
versions are published and subscribers come and go.
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

    def ready(self, v: int) -> str:
        return f"{self.p}v/{v}/ready"

    def acked(self, v: int) -> str:
        return f"{self.p}v/{v}/acked"

    def free(self, v: int) -> str:
        return f"{self.p}v/{v}/free"

    def version_keys(self, v: int, epoch: int, world_size: int, checksums: bool) -> list[str]:
        """Every per-version key of ``v`` (snap counters of this epoch and the one before)."""
        keys = [self.snap(v, epoch), self.ready(v), self.acked(v), self.free(v)]
        if epoch > 1:
            keys.append(self.snap(v, epoch - 1))
        if checksums:
            keys += [self.sums(v, r) for r in range(world_size)]
        return keys

    def fence(self, slot: int) -> str:
        return f"{self.p}slot/{slot}/fence"

    def sub(self, i: int, what: str = "") -> str:
        return f"{self.p}sub/{i}" + (f"/{what}" if what else "")
