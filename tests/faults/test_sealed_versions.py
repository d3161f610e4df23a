"""What a subscriber plans and verifies a version from is sealed to that version: a store client
without the token that deletes, alters or replays store keys gets a typed error or changes nothing,
never weights other than the version's reported as that version.

The attacker is this test process: a plain etcd client (no token) that lists, deletes and rewrites
the channel's keys. Publishers are real processes; the subscribers run here.

- A deleted rank record of a version (the packing generation its slot holds) is never read as
  "plain": the committing rank refuses to commit the version (``StoreError`` naming the key).
- Every key a pull reads, deleted, altered or replayed one at a time: each pull raises a typed
  error or is bit-exact.
- A trainer restarted at the same epoch number in a store that lost its history (the old generation
  record put back) is noticed: nothing of the old history serves as a delta base, and an old
  checksum record put back verifies nothing.
"""

from __future__ import annotations

import base64
import json
import re
import urllib.request

import pytest

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, WorkerError, call_all, free_port
from wbridge import Async, Delta, IntegrityError, Staging, Subscriber, WBridgeError
from wbridge.testing.synthetic import ModelConfig, make_tensors, mismatches

from .actors import FaultPub

pytestmark = [pytest.mark.timeout(240)]


class Attacker:
    """A client of the store without the channel's token: lists, reads, writes and deletes raw keys
    through etcd's HTTP API."""

    def __init__(self, url: str) -> None:
        hostport, _, prefix = url.removeprefix("etcd://").partition("/")
        self.base = f"http://{hostport}/v3/kv/"
        self.prefix = ("/" + prefix).encode()

    def _post(self, what: str, body: dict) -> dict:
        req = urllib.request.Request(self.base + what, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    @staticmethod
    def _b(x: bytes) -> str:
        return base64.b64encode(x).decode()

    def dump(self) -> dict[str, bytes]:
        """Every key of the store under the channel's prefix (without it) and its value."""
        end = self.prefix[:-1] + bytes([self.prefix[-1] + 1])
        got = self._post("range", {"key": self._b(self.prefix), "range_end": self._b(end)})
        return {
            base64.b64decode(kv["key"])[len(self.prefix) :].decode(): base64.b64decode(kv.get("value", ""))
            for kv in got.get("kvs", [])
        }

    def set(self, key: str, value: bytes) -> None:
        self._post("put", {"key": self._b(self.prefix + key.encode()), "value": self._b(value)})

    def delete(self, key: str) -> None:
        self._post("deleterange", {"key": self._b(self.prefix + key.encode())})

    def wipe(self) -> None:
        for key in self.dump():
            self.delete(key)


def _pub(url: str, rank: int, world: int, **kw) -> Worker:
    opts = dict(model_kind="tiny", mode=Async(max_staleness=100), transport="tcp") | kw
    return Worker(f"pub{rank}", FaultPub, url, rank, world, world, **opts)


def _subscriber(url: str, fused: bool = True, tp: int = 4, **kw) -> tuple[Subscriber, dict]:
    """A subscriber of TP rank 0 of ``tp`` (a TP=4 reader of TP=2 publishers: they pack for it)."""
    tensors = make_tensors(ModelConfig.tiny(), tp, 0, fused=fused, fill_value=0xA5)
    sub = Subscriber("t", url, token=TOKEN, transport="tcp", connect_timeout=10, **kw)
    sub.register(tensors)
    return sub, tensors


def _record(raw: bytes) -> dict:
    return json.loads(json.loads(raw)["body"])


def _version_key(dump: dict[str, bytes]) -> str:
    return next(k for k in dump if k.endswith("/version") and "/v/" not in k)


# -- a version's per-rank record deleted before the commit -----------------------------------------


@pytest.mark.parametrize("verify", [False, True])
def test_a_deleted_rank_record_of_a_version_commits_nothing(etcd_url, verify: bool) -> None:
    """Rank 0 publishes version 3 (a packed slot), then the attacker deletes every record rank 0
    wrote for version 3 but its checksums; rank 1 then counts the last snapshot. The commit must not
    read the missing packing generation as "plain" (that made subscribers scatter rank 0's packed
    slot as if it were plain: 130,560 of 131,072 elements wrong, reported as success)."""
    attacker = Attacker(etcd_url)
    pubs = [_pub(etcd_url, r, 2, staging=Staging(checksums=True)) for r in range(2)]  # (the default now)
    sub, tensors = _subscriber(etcd_url, verify=verify)
    try:
        for v in (1, 2):
            call_all(pubs, "publish", v)
            assert sub.pull(timeout=30.0) == v and mismatches(tensors, v) == []
        rec = _record(attacker.dump()[_version_key(attacker.dump())])
        assert rec["v"] == 2 and rec["packing"][0], f"rank 0 did not pack for the reader: {rec}"
        pubs[0].call("publish", 3)
        gone = [k for k in attacker.dump() if re.search(r"/v/3/[^/]+/0$", k) and "/sum/" not in k]
        assert gone, "rank 0 wrote no record of its own for version 3"
        for k in gone:
            attacker.delete(k)
        try:
            pubs[1].call("publish", 3)
            error = None
        except WorkerError as e:
            error = e
        got = sub.pull(timeout=3.0)
        assert mismatches(tensors, got) == [], f"version {got} reported as pulled, with wrong bytes"
        assert got == 2, "a version whose rank record was deleted was committed"
        assert error is not None and error.exc_type == "StoreError", error
        assert gone[0].split("/v/")[1] in str(error), error  # the error names the key
        # the ranks stay in step: the next version commits and is pulled bit-exactly
        assert [r["v"] for r in call_all(pubs, "publish", 4)] == [4, 4]
        assert sub.pull(timeout=30.0) == 4 and mismatches(tensors, 4) == []
    finally:
        sub.close()
        for p in pubs:
            p.stop()


# -- every key a pull reads, one at a time -------------------------------------------------------------


def _tampered(value: bytes, how: str, older: bytes | None) -> bytes | None:
    """``value`` deleted (None), with one byte flipped, or replayed from an older version."""
    if how == "delete":
        return None
    if how == "flip":
        i = len(value) // 2
        return value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1 :]
    return older


def _kind(key: str, v: int) -> str:
    return key.replace(f"/v/{v}/", "/v/{v}/")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_every_store_key_a_pull_reads_deleted_altered_or_replayed(etcd_url) -> None:
    """Two publisher ranks with deltas, checksums and a packing reader; before each pull the
    attacker deletes, flips a byte of, or replays (the same key's value one version earlier) one key
    of the channel, every key in turn. Each pull raises a typed error or is bit-exact, with deltas
    and with ``verify``."""
    attacker = Attacker(etcd_url)
    pubs = [_pub(etcd_url, r, 2, staging=Staging(delta=Delta(history=4))) for r in range(2)]
    subs = [_subscriber(etcd_url), _subscriber(etcd_url, fused=False, verify=True, staged=True)]
    v = 0
    outcomes: dict[str, int] = {"exact": 0, "error": 0}

    def publish() -> dict[str, bytes]:
        nonlocal v
        v += 1
        call_all(pubs, "publish", v)
        return attacker.dump()

    try:
        before = publish()
        for sub, tensors in subs:
            assert sub.pull(timeout=30.0) == v and mismatches(tensors, v) == []
        now = publish()
        kinds = sorted({_kind(k, v) for k in now})
        for kind in kinds:
            for how in ("delete", "flip", "replay"):
                key = kind.replace("{v}", str(v))
                old = before.get(kind.replace("{v}", str(v - 1)))
                if key not in now or (how == "replay" and (old is None or old == now[key])):
                    continue
                bad = _tampered(now[key], how, old)
                if bad is None:
                    attacker.delete(key)
                else:
                    attacker.set(key, bad)
                try:
                    for sub, tensors in subs:
                        try:
                            got = sub.pull(timeout=1.5)
                        except WBridgeError:
                            outcomes["error"] += 1
                            continue
                        assert mismatches(tensors, got) == [], f"{how} {key}: version {got} pulled with wrong bytes"
                        outcomes["exact"] += 1
                finally:
                    attacker.set(key, now[key])
                for sub, tensors in subs:  # the subscribers still work once the key is back
                    assert sub.pull(timeout=30.0) == v and mismatches(tensors, v) == [], f"after {how} {key}"
                before, now = now, publish()
        assert len(kinds) >= 15 and outcomes["error"] > 0 and outcomes["exact"] > 0, (kinds, outcomes)
    finally:
        for sub, _ in subs:
            sub.close()
        for p in pubs:
            p.stop()


# -- a trainer restarted at the same epoch number ------------------------------------------------------


class SparsePub(FaultPub):
    """A trainer rank whose steps change a few words (so versions have deltas, as training steps
    do): ``step(seed)`` adds one unit in the last place to 1% of its bf16 words."""

    def step(self, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        for t, _ in self.tensors.values():
            words = t.view(-1).view(torch.int16)
            idx = torch.randint(0, words.numel(), (max(1, words.numel() // 100),), generator=gen)
            words[idx] += 1

    def full(self) -> dict:
        """Its tensors by canonical name (numpy), the reference a subscriber's bytes are checked against."""
        import torch

        return {decl.name: t.view(torch.int16).numpy().copy() for t, decl in self.tensors.values()}


def _expected_bytes(tensors: dict, full: dict) -> list[str]:
    """Names of a subscriber's tensors (unfused row/column shards) whose bytes differ from the slices
    of the publisher's canonical tensors ``full`` (plain slicing: no planner)."""
    import torch

    bad = []
    for name, (t, decl) in tensors.items():
        at = decl.offsets or (0,) * t.dim()
        want = full[decl.name][tuple(slice(o, o + n) for o, n in zip(at, t.shape))]
        if not (t.view(torch.int16).numpy() == want).all():
            bad.append(name)
    return bad


def test_a_same_epoch_restart_never_serves_the_old_history(etcd_url) -> None:
    """Trainer A publishes versions 1-4 (training steps: each changes 1% of the words, so versions
    have deltas); a subscriber reading a TP=2 shard (the publishers pack for it) holds A's version 3.
    The store is wiped, the attacker puts A's generation record back, and trainer B, restarted from
    the initial weights on the same tcp port, publishes its own versions 1-4 at epoch 1 again. The
    subscriber must notice the new history: a full pull of B's version 4, A's version 3 refused as a
    base (before, it matched B's version 3 by number and epoch: B's delta 3->4 was applied onto it,
    or declined only by cost). Then the attacker
    puts A's checksum record of version 4 back over B's: a verifying subscriber refuses it
    (``IntegrityError`` naming the key) or is bit-exact."""
    attacker = Attacker(etcd_url)
    kw = dict(staging=Staging(delta=Delta(history=4)), transport_options={"tcp": {"port": free_port()}})
    kw["mode"] = Async(max_staleness=100)
    shard = lambda: make_tensors(ModelConfig.tiny(), 2, 0, fused=False, fill_value=0xA5)  # noqa: E731
    plain_tensors, checked_tensors = shard(), shard()
    plain = Subscriber("t", etcd_url, token=TOKEN, transport="tcp", connect_timeout=10)
    checked = Subscriber("t", etcd_url, token=TOKEN, transport="tcp", connect_timeout=10, verify=True)
    plain.register(plain_tensors)
    checked.register(checked_tensors)
    a = Worker("trainer-a", SparsePub, etcd_url, 0, 1, 1, model_kind="tiny", transport="tcp", **kw)
    try:
        for v in (1, 2, 3):
            if v > 1:
                a.call("step", v)
            assert a.call("api", "publish", timeout=30.0) == v
            if v != 2:  # the subscriber's one delta pull (3 onto 1) before the restart: a probe
                assert plain.pull(timeout=30.0) == v and _expected_bytes(plain_tensors, a.call("full")) == []
            assert checked.pull(timeout=30.0) == v
        assert plain.stats.last.delta, f"no delta pull before the restart: {plain.stats.last}"
        a.call("step", 4)
        assert a.call("api", "publish", timeout=30.0) == 4
        old = attacker.dump()
        gen_key = next(k for k in old if k.endswith("/gen"))
        sums4 = {k: val for k, val in old.items() if re.search(r"/v/4/sum/0$", k)}
        assert sums4, "trainer A kept no checksums of version 4"
    finally:
        a.stop()
    attacker.wipe()
    attacker.set(gen_key, old[gen_key])  # the old generation record, put back
    b = Worker("trainer-b", SparsePub, etcd_url, 0, 1, 1, model_kind="tiny", transport="tcp", **kw)
    try:
        for v in (1, 2, 3, 4):
            if v > 1:
                b.call("step", 100 + v)  # other steps than A's
            assert b.call("api", "publish", timeout=30.0) == v
        assert _record(attacker.dump()[_version_key(attacker.dump())])["epoch"] == 1  # the same epoch
        full = b.call("full")
        assert plain.pull(timeout=30.0) == 4
        last = plain.stats.last
        assert _expected_bytes(plain_tensors, full) == [], "the subscriber holds other weights than B's v4"
        # the base A's version 3 is refused for what it is (another history), whatever deltas would cost
        assert last.delta_reason == "no-base", f"A's version 3 was taken as a delta base for B's: {last}"
        assert not last.delta and last.repaired == 0, f"a delta onto the old history's version: {last}"
        for key, val in sums4.items():
            attacker.set(key, val)  # A's checksums of version 4 over B's
        try:
            got = checked.pull(timeout=10.0)
        except IntegrityError as e:
            assert "/sum/0" in str(e), e
        else:
            assert got == 4 and _expected_bytes(checked_tensors, full) == []
    finally:
        plain.close()
        checked.close()
        b.stop()
