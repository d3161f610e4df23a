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


def _subscriber(url: str, fused: bool = True, **kw) -> tuple[Subscriber, dict]:
    tensors = make_tensors(ModelConfig.tiny(), 2, 0, fused=fused, fill_value=0xA5)
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
    pubs = [_pub(etcd_url, r, 2) for r in range(2)]
    sub, tensors = _subscriber(etcd_url, verify=verify)
    try:
        for v in (1, 2):
            call_all(pubs, "publish", v)
            assert sub.pull(timeout=30.0) == v and mismatches(tensors, v) == []
        rec = _record(attacker.dump()[_version_key(attacker.dump())])
        assert rec["v"] == 2 and any(rec["packing"]), f"the publishers did not pack for the reader: {rec}"
        pubs[0].call("publish", 3)
        gone = [k for k in attacker.dump() if re.search(r"/v/3/[^/]+/0$", k) and "/sum/" not in k]
        assert gone, "rank 0 wrote no record of its own for version 3"
        for k in gone:
            attacker.delete(k)
        with pytest.raises(WorkerError, match="StoreError") as info:
            pubs[1].call("publish", 3)
        assert gone[0].split("/v/")[1] in str(info.value), info.value  # the error names the key
        got = sub.pull(timeout=3.0)
        assert mismatches(tensors, got) == [], f"version {got} reported as pulled, with wrong bytes"
        assert got == 2, "a version whose rank record was deleted was committed"
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


def test_a_same_epoch_restart_never_serves_the_old_history(etcd_url) -> None:
    """Trainer A publishes versions 1-4 (contents 1-4); a packing subscriber holds 3. The store is
    wiped, the attacker puts A's generation record back, and trainer B (a restart: same channel,
    same tcp port, epoch 1 again) publishes versions 1-4 with contents 101-104; the attacker then
    puts A's checksum record of version 4 back over B's. The subscriber must notice the new history:
    no delta onto A's version 3 (its number and epoch match B's), B's version 4 bit-exact; a verifying
    subscriber refuses A's checksum record (``IntegrityError``) or is bit-exact."""
    attacker = Attacker(etcd_url)
    port = free_port()
    kw = dict(staging=Staging(delta=Delta(history=4)), transport_options={"tcp": {"port": port}})
    plain, plain_tensors = _subscriber(etcd_url)
    checked, checked_tensors = _subscriber(etcd_url, fused=False, verify=True)
    a = _pub(etcd_url, 0, 1, **kw)
    try:
        for v in (1, 2, 3):
            a.call("publish", v)
            assert plain.pull(timeout=30.0) == v and checked.pull(timeout=30.0) == v
        assert mismatches(plain_tensors, 3) == [] and mismatches(checked_tensors, 3) == []
        a.call("publish", 4)
        old = attacker.dump()
        gen_key = next(k for k in old if k.endswith("/gen"))
        sums4 = {k: val for k, val in old.items() if re.search(r"/v/4/sum/0$", k)}
        assert sums4, "trainer A kept no checksums of version 4"
    finally:
        a.stop()
    attacker.wipe()
    attacker.set(gen_key, old[gen_key])  # the old generation record, put back
    b = _pub(etcd_url, 0, 1, **kw)
    try:
        for v in (1, 2, 3, 4):
            assert b.call("publish", 100 + v)["v"] == v  # contents 101..104 as versions 1..4
        assert _record(attacker.dump()[_version_key(attacker.dump())])["epoch"] == 1  # the same epoch
        for key, val in sums4.items():
            attacker.set(key, val)  # A's checksums of version 4 over B's
        got = plain.pull(timeout=30.0)
        last = plain.stats.last
        assert got == 4 and mismatches(plain_tensors, 104) == [], "the subscriber holds other weights than B's v4"
        assert not last.delta and last.repaired == 0, f"a delta onto the old history's version: {last}"
        try:
            got = checked.pull(timeout=10.0)
        except IntegrityError as e:
            assert "/sum/0" in str(e)
        else:
            assert got == 4 and mismatches(checked_tensors, 104) == []
    finally:
        plain.close()
        checked.close()
        b.stop()
