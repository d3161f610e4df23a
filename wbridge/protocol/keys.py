"""Store keys of a channel: the one place that names what lives where in the store.

Layout of a channel ``c`` in store generation ``g`` (all records sealed with the token, see
``records``; the generation is part of every key, so of every record's signature)::

    wb/c/gen                        the generation record: a nonce drawn by the first client to
                                    find the store without one (a fresh or wiped store)
    wb/c/g/<g>/reg                  registration counter; epoch = (count - 1) // world_size + 1
    wb/c/g/<g>/e/<e>/r/<rank>       publisher rank record: layout, world size, host, transports
    wb/c/g/<g>/meta                 the channel metadata of the newest registration and its epoch,
                                    written by publisher rank 0 at each register (``meta``)
    wb/c/g/<g>/e/<e>/r/<rank>/packed/<k>  slot layout of packing generation k of that rank
    wb/c/g/<g>/version              the newest committed version's record (v, epoch, slot, fence)
    wb/c/g/<g>/v/<v>/e/<e>/snap     how many publisher ranks of epoch e snapshotted v
    wb/c/g/<g>/v/<v>/sum/<rank>     per-rank chunk checksums of v (when enabled), bound to v, the
                                    rank's incarnation and its slot layout (``checksum``)
    wb/c/g/<g>/v/<v>/rank/<rank>    rank's part of v: its incarnation, the packing generation and
                                    layout hash of its slot; the committer seals them into the
                                    version record (``version.RankPart``)
    wb/c/g/<g>/v/<v>/ready          written once v is committed: subscribers block on it appearing
    wb/c/g/<g>/v/<v>/acked          written once every live subscriber acked v or later
    wb/c/g/<g>/v/<v>/free           written once no live subscriber reads (an older version in)
                                    the slot that v is about to overwrite
    wb/c/g/<g>/layout/<hash>        a subscriber layout, announced once per distinct layout
    wb/c/g/<g>/readers              the layout hashes of the live subscribers, as of the
                                    aggregating publisher rank's last scan (``wbridge.publish.tracker``)
    wb/c/g/<g>/aggregating          the key the aggregating rank waits for and a count of its
                                    beats, while a wait of its lasts (``wbridge.publish.tracker``)
    wb/c/g/<g>/slot/<s>/fence       bumped by every rank before it overwrites slot s
    wb/c/g/<g>/subs                 subscriber counter; subscriber ids are 1, 2, ...
    wb/c/g/<g>/sub/<i>              subscriber record
    wb/c/g/<g>/sub/<i>/live         its lease
    wb/c/g/<g>/sub/<i>/state        "<acked> <reading>": last version applied, version being read
    wb/c/g/<g>/zone/<z>/n           relay counter of zone z; relay records are numbered 1, 2, ...
    wb/c/g/<g>/zone/<z>/relay/<k>   relay record: its layout hash, endpoints, regions, the version
                                    it holds and which byte ranges of it are complete (``wbridge.pull.relay``)
    wb/c/g/<g>/zone/<z>/ann         announcement counter of zone z: a relay bumps it each time it
                                    announces bytes new to the zone (read from publishers)
    wb/c/g/<g>/zone/<z>/ann/<n>     written by announcement n: readers waiting for ranges block on
                                    the next one appearing

``Keys(c)`` (no generation) names only ``generation``; its other keys are those of a store
without generations.

``acked`` and ``free`` are written by the aggregating publisher rank (rank 0), which alone reads
every subscriber's lease and state (one batched read per poll); the other ranks block on those keys
appearing (see ``wbridge.publish.tracker``).

Garbage collection: the committer of v deletes ``v/<v>/e/<e>/snap`` (every rank added to it) and
the ``v/<v - lag>/...`` keys (``lag`` = slots + 2, ``version_keys``), each publisher rank deletes its
``e/<e>/r/<rank>`` record and packed layouts two epochs after ``e`` when it registers again, and
the aggregating publisher rank deletes the three ``sub/<i>`` keys of a
subscriber once its lease lapsed, with the relay record its subscriber record names (readers of a
zone delete those of dead relays too; a relay deletes old ``ann/<n>`` keys as it announces, keeping
at most the last ``2 * wbridge.pull.relay.ANN_KEEP``), so the store holds a bounded number of keys however many
versions are published and subscribers come and go.
"""

from __future__ import annotations

from ..errors import UsageError

MAX_CHANNEL = 128  # characters of a channel name (part of every store key)

# Counters that number records (``subs``, ``zone/<z>/n``) are plain store values any store client
# can write. A jump by more than ``COUNTER_JUMP_MAX`` since a reader's last look is no burst of
# joins but a forged value: the numbers in between are not looked at (only the newest
# ``COUNTER_WINDOW``, which real joins after the write get), and it is logged.
COUNTER_JUMP_MAX = 4096
COUNTER_WINDOW = 64


class Keys:
    def __init__(self, channel: str, gen: str = "") -> None:
        if not isinstance(channel, str) or not channel or "/" in channel or len(channel) > MAX_CHANNEL:
            shown = channel if not isinstance(channel, str) or len(channel) <= 40 else f"{channel[:40]}..."
            raise UsageError(f"channel name {shown!r} must be 1 to {MAX_CHANNEL} characters without '/'")
        self.channel, self.gen = channel, gen
        self.base = f"wb/{channel}/"
        self.p = self.base + (f"g/{gen}/" if gen else "")

    generation = property(lambda self: self.base + "gen")
    reg = property(lambda self: self.p + "reg")
    version = property(lambda self: self.p + "version")
    meta = property(lambda self: self.p + "meta")
    subs = property(lambda self: self.p + "subs")
    readers = property(lambda self: self.p + "readers")
    aggregating = property(lambda self: self.p + "aggregating")

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

    def ready(self, v: int) -> str:
        return f"{self.p}v/{v}/ready"

    def acked(self, v: int) -> str:
        return f"{self.p}v/{v}/acked"

    def free(self, v: int) -> str:
        return f"{self.p}v/{v}/free"

    def version_keys(self, v: int, epoch: int, world_size: int, checksums: bool) -> list[str]:
        """Every per-version key of ``v`` (snap counters of this epoch and the one before)."""
        keys = [self.snap(v, epoch), self.ready(v), self.acked(v), self.free(v)]
        keys += [self.part(v, r) for r in range(world_size)]
        if epoch > 1:
            keys.append(self.snap(v, epoch - 1))
        if checksums:
            keys += [self.sums(v, r) for r in range(world_size)]
        return keys

    def packed(self, epoch: int, rank: int, gen: int) -> str:
        return f"{self.rank(epoch, rank)}/packed/{gen}"

    def part(self, v: int, rank: int) -> str:
        return f"{self.p}v/{v}/rank/{rank}"

    def reader_layout(self, h: str) -> str:
        return f"{self.p}layout/{h}"

    def fence(self, slot: int) -> str:
        return f"{self.p}slot/{slot}/fence"

    def zone_count(self, zone: str) -> str:
        return f"{self.p}zone/{zone}/n"

    def zone_relay(self, zone: str, k: int) -> str:
        return f"{self.p}zone/{zone}/relay/{k}"

    def zone_announced(self, zone: str) -> str:
        return f"{self.p}zone/{zone}/ann"

    def zone_announcement(self, zone: str, n: int) -> str:
        return f"{self.p}zone/{zone}/ann/{n}"

    def sub(self, i: int, what: str = "") -> str:
        return f"{self.p}sub/{i}" + (f"/{what}" if what else "")

    def lease(self, i: int, tag: str) -> str:
        """Subscriber ``i``'s lease key, for the join that drew ``tag`` (in its record): a history
        put back after a store loss counts ids from 1 again, and a subscriber of the lost history
        that holds the same id must not keep the new one's lease alive."""
        return self.sub(i, f"live/{tag}")
