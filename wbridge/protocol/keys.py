"""Store keys of a channel: the one place that names what lives where in the store.

Layout of a channel ``c`` in store generation ``g`` (all records sealed with the token, see
``records``; the generation is part of every key, so of every record's signature)::

    wb/c/gen                        the generation record: a nonce drawn by the first client to
                                    find the store without one (a fresh or wiped store)
    wb/c/g/<g>/reg                  registration counter; epoch = (count - 1) // world_size + 1
    wb/c/g/<g>/e/<e>/r/<rank>       publisher rank record: layout, world size, host, transports
    wb/c/g/<g>/version              the newest committed version's record (v, epoch, slot, fence)
    wb/c/g/<g>/v/<v>/e/<e>/snap     how many publisher ranks of epoch e snapshotted v
    wb/c/g/<g>/v/<v>/sum/<rank>     per-rank chunk checksums of v (when enabled)
    wb/c/g/<g>/slot/<s>/fence       bumped by every rank before it overwrites slot s
    wb/c/g/<g>/subs                 subscriber counter; subscriber ids are 1, 2, ...
    wb/c/g/<g>/sub/<i>              subscriber record;  .../live lease, .../acked, .../reading

``Keys(c)`` (no generation) names only ``generation``; its other keys are those of a store
without generations.
"""

from __future__ import annotations

from ..errors import UsageError


class Keys:
    def __init__(self, channel: str, gen: str = "") -> None:
        if not isinstance(channel, str) or not channel or "/" in channel:
            raise UsageError(f"channel name {channel!r} must be a non-empty string without '/'")
        self.channel, self.gen = channel, gen
        self.base = f"wb/{channel}/"
        self.p = self.base + (f"g/{gen}/" if gen else "")

    generation = property(lambda self: self.base + "gen")
    reg = property(lambda self: self.p + "reg")
    version = property(lambda self: self.p + "version")
    subs = property(lambda self: self.p + "subs")

    def at(self, gen: str) -> Keys:
        """The keys of this channel in store generation ``gen``."""
        return Keys(self.channel, gen)

    def rank(self, epoch: int, rank: int) -> str:
        return f"{self.p}e/{epoch}/r/{rank}"

    def snap(self, v: int, epoch: int) -> str:
        # per epoch: ranks that died half-way through publishing v must not count toward the
        # commit of the v that their restarted selves publish in the next epoch
        return f"{self.p}v/{v}/e/{epoch}/snap"

    def sums(self, v: int, rank: int) -> str:
        return f"{self.p}v/{v}/sum/{rank}"

    def fence(self, slot: int) -> str:
        return f"{self.p}slot/{slot}/fence"

    def sub(self, i: int, what: str = "") -> str:
        return f"{self.p}sub/{i}" + (f"/{what}" if what else "")
