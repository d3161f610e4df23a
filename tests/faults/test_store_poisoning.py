"""The store is untrusted. Whoever can write to it must not be able to redirect or poison a pull:
forged, unsigned, tampered and replayed records are rejected (``AuthError``) before a byte moves,
and the subscriber's tensors keep every byte they had. Also: a client holding the token still
cannot read outside a publisher's registered regions.

The attacker here is the test process itself: it hosts the store and rewrites keys between pulls.
Publishers are two real processes (TP=2); each test opens a fresh subscriber in this process.
"""

from __future__ import annotations

import base64
import json
import socket

import numpy as np
import pytest
import torch

from tests.runtime.actors import TOKEN
from tests.runtime.harness import Worker, call_all, free_port
from transports.base import ReadBatch, decode_descriptor, encode_descriptor
from transports.errors import TransportError as WireError
from transports.tcp import TcpTransport
from wbridge import Async, AuthError, Staging, StoreError, Subscriber, WBridgeError, open_store
from wbridge.protocol import generation
from wbridge.protocol.channel import ChannelStore
from wbridge.protocol.keys import Keys
from wbridge.protocol.records import open_sealed, seal
from wbridge.testing.synthetic import ModelConfig, make_tensors, mismatches

pytestmark = pytest.mark.timeout(60)

GARBAGE = 0xA5
KEYS = Keys("t")
TOKEN_B = TOKEN.encode()
ATTACKER = b"attacker-token"


@pytest.fixture(scope="module")
def channel():
    """A store hosted here, two publisher ranks (TP=2) that published versions 1 and 2."""
    store = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    pubs = [Worker(f"pub{r}", _pub_factory, store.url, r) for r in range(2)]
    try:
        global KEYS  # the channel's keys in this store
        KEYS = Keys(
            "t", generation.current(ChannelStore(store, Keys("t"), TOKEN_B))
        )  # the channel's keys in this store
        history = {}
        for v in (1, 2):
            call_all(pubs, "publish", v)
            history[v] = store.get(KEYS.version)  # what anyone watching the store saw
        store.history = history
        yield store
    finally:
        for p in pubs:
            p.stop()
        store.close()


def _pub_factory(url: str, rank: int):
    from .actors import FaultPub

    return FaultPub(
        url,
        rank,
        2,
        2,
        model_kind="tiny",
        mode=Async(max_staleness=100),
        transport="tcp",
        staging=Staging(checksums=True),
    )


class Tampered:
    """Rewrites store keys for the length of a ``with`` block, then puts the originals back."""

    def __init__(self, store, changes: dict[str, bytes]) -> None:
        self.store, self.changes = store, changes
        self.saved = {k: store.get(k) for k in changes}

    def __enter__(self) -> Tampered:
        for k, v in self.changes.items():
            self.store.set(k, v)
        return self

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                self.store.delete(k)
            else:
                self.store.set(k, v)


def subscriber(store, **kwargs) -> tuple[Subscriber, dict]:
    tensors = make_tensors(ModelConfig.tiny(), 1, 0, fused=False, fill_value=GARBAGE)
    sub = Subscriber("t", store.url, token=TOKEN, transport="tcp", connect_timeout=10, **kwargs)
    sub.register(tensors)
    return sub, tensors


def untouched(tensors: dict, byte: int = GARBAGE) -> bool:
    return all(bool((t.view(-1).view(torch.uint8) == byte).all()) for t, _ in tensors.values())


def body(raw: bytes) -> dict:
    return json.loads(json.loads(raw)["body"])


def rewrap(raw: bytes, payload: dict) -> bytes:
    """The record with its payload replaced and its original signature kept."""
    outer = json.loads(raw)
    outer["body"] = json.dumps(payload, separators=(",", ":"), sort_keys=True)
    return json.dumps(outer, separators=(",", ":")).encode()


def rejected(store, changes: dict[str, bytes], error: type[WBridgeError] = AuthError, **sub_kwargs) -> str:
    """Pulls through the tampered store with a fresh subscriber; the pull must fail with ``error``
    and leave every destination byte as it was."""
    sub, tensors = subscriber(store, **sub_kwargs)
    try:
        with Tampered(store, changes):
            with pytest.raises(error) as info:
                sub.pull(timeout=5.0)
        assert sub.version is None
        assert untouched(tensors), "a rejected pull wrote into the subscriber's tensors"
        return str(info.value)
    finally:
        sub.close()


def test_clean_pull_first(channel) -> None:
    """The set-up works: without tampering a fresh subscriber gets version 2 bit-exactly."""
    sub, tensors = subscriber(channel)
    try:
        assert sub.pull(timeout=20.0) == 2
        assert mismatches(tensors, 2) == []
    finally:
        sub.close()


# -- version records -----------------------------------------------------------------------------


def test_version_record_forged_with_another_token(channel) -> None:
    rec = body(channel.get(KEYS.version))
    forged = seal(ATTACKER, KEYS.version, dict(rec, v=rec["v"] + 1))
    msg = rejected(channel, {KEYS.version: forged})
    assert KEYS.version in msg


def test_version_record_unsigned(channel) -> None:
    raw = channel.get(KEYS.version)
    outer = dict(json.loads(raw), mac="")
    rejected(channel, {KEYS.version: json.dumps(outer).encode()})


def test_version_record_bare_payload_is_malformed(channel) -> None:
    """No envelope at all: not even a record; refused as malformed store data."""
    rejected(channel, {KEYS.version: json.dumps(body(channel.get(KEYS.version))).encode()}, error=StoreError)


def test_version_record_rewritten_keeping_its_signature(channel) -> None:
    raw = channel.get(KEYS.version)
    rec = body(raw)
    rejected(channel, {KEYS.version: rewrap(raw, dict(rec, slot=1 - rec["slot"], fence=rec["fence"] - 1))})


def test_version_record_replayed_from_another_channel(channel) -> None:
    """A record validly sealed by a publisher of channel ``other`` (same token), copied into ``t``."""
    other = Keys("other")
    genuine_elsewhere = seal(TOKEN_B, other.version, body(channel.get(KEYS.version)))
    assert open_sealed(TOKEN_B, other.version, genuine_elsewhere)  # valid where it came from
    rejected(channel, {KEYS.version: genuine_elsewhere})


# -- publisher rank records (layout and transport descriptors) -------------------------------------


def _redirected(raw: bytes, host: str, port: int) -> dict:
    """Rank record payload pointing the tcp transport at ``host:port`` and at a bigger region 7."""
    rec = body(raw)
    tcp = rec["transports"]["tcp"]
    ep = json.loads(base64.b64decode(tcp["endpoint"]))
    tcp["endpoint"] = base64.b64encode(encode_descriptor("tcp", host=host, port=port, instance=ep["instance"])).decode()
    for slot in tcp["regions"]:
        for i, d in enumerate(slot):
            desc = json.loads(base64.b64decode(d))
            slot[i] = base64.b64encode(
                encode_descriptor("tcp", instance=desc["instance"], region=7, nbytes=desc["nbytes"] * 4)
            ).decode()
    rec["layout"]["tensors"] = rec["layout"]["tensors"][::-1]
    return rec


@pytest.mark.parametrize("how", ["signature-kept", "resealed-by-attacker"])
def test_rank_record_redirected_to_another_address(channel, how: str) -> None:
    rec_key = KEYS.rank(1, 0)
    raw = channel.get(rec_key)
    with socket.create_server(("127.0.0.1", 0)) as trap:
        trap.setblocking(False)
        payload = _redirected(raw, "127.0.0.1", trap.getsockname()[1])
        forged = rewrap(raw, payload) if how == "signature-kept" else seal(ATTACKER, rec_key, payload)
        msg = rejected(channel, {rec_key: forged})
        assert rec_key in msg
        with pytest.raises(BlockingIOError):
            trap.accept()  # the subscriber never connected to the address the attacker gave


def test_rank_record_replayed_under_another_rank(channel) -> None:
    rejected(channel, {KEYS.rank(1, 1): channel.get(KEYS.rank(1, 0))})


def test_rank_record_replayed_into_a_later_epoch(channel) -> None:
    """Epoch 1's genuine records copied to epoch 2's keys, with a version claiming epoch 2."""
    raw = channel.get(KEYS.version)
    rec = body(raw)
    changes = {KEYS.rank(2, r): channel.get(KEYS.rank(1, r)) for r in range(2)}
    changes[KEYS.version] = seal(ATTACKER, KEYS.version, dict(rec, epoch=2))
    rejected(channel, changes)
    # even with a genuine version record for epoch 2 (as if the token leaked only for the version
    # key), the replayed rank records are refused
    changes[KEYS.version] = seal(TOKEN_B, KEYS.version, dict(rec, epoch=2))
    msg = rejected(channel, changes)
    assert KEYS.rank(2, 0) in msg or KEYS.rank(2, 1) in msg


# -- checksum records --------------------------------------------------------------------------------


def test_checksums_replayed_from_an_older_version(channel) -> None:
    """v1's checksums copied over v2's: the verified, staged pull fails and commits nothing."""
    changes = {KEYS.sums(2, r): channel.get(KEYS.sums(1, r)) for r in range(2)}
    rejected(channel, changes, verify=True, staged=True)


# -- rollback ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_old_version_record_replayed_does_not_roll_a_subscriber_back(channel) -> None:
    """v1's genuine version record, saved when it was current and written back after v2: the
    signature is valid (same key, same token), so only the subscriber's own memory can refuse it."""
    sub, tensors = subscriber(channel)
    try:
        assert sub.pull(timeout=20.0) == 2
        with Tampered(channel, {KEYS.version: channel.history[1]}):
            try:
                got = sub.pull(timeout=3.0)
            except WBridgeError:
                got = None
        assert got in (None, 2), f"pull returned version {got} after holding version 2"
        assert sub.version == 2 and mismatches(tensors, 2) == []
    finally:
        sub.close()


# -- reads outside registered regions, over the wire -----------------------------------------------


def test_read_outside_a_registered_region_is_refused_by_the_publisher(channel) -> None:
    """A client with the token that lies to itself about a region's size (a forged descriptor that
    passes its own bounds check) is refused by the publisher's server, and nothing lands."""
    rec = open_sealed(TOKEN_B, KEYS.rank(1, 0), channel.get(KEYS.rank(1, 0)))
    tcp = rec["transports"]["tcp"]
    endpoint = base64.b64decode(tcp["endpoint"])
    real = decode_descriptor("tcp", base64.b64decode(tcp["regions"][0][0]), ("instance", "region", "nbytes"))
    size = int(real["nbytes"])
    big = encode_descriptor("tcp", instance=real["instance"], region=real["region"], nbytes=size * 2)
    ghost = encode_descriptor("tcp", instance=real["instance"], region=10_000, nbytes=size)
    dst = np.full(4096, GARBAGE, dtype=np.uint8)
    with TcpTransport(token=TOKEN, streams=1) as t:
        local = t.register(dst.ctypes.data, dst.nbytes)
        peer = t.connect(endpoint, timeout=10.0)
        inside = t.prepare(peer, [big], [local], ReadBatch.of([(0, size - 16, 0, 0, 16)]))
        t.read(inside, timeout=10.0)  # the honest control: the last 16 bytes of the region
        assert not (dst[:16] == GARBAGE).all() or size < 16
        dst[:] = GARBAGE
        for desc, offset, n in [(big, size - 16, 32), (big, size, 1), (big, size + 100, 4096), (ghost, 0, 16)]:
            prep = t.prepare(peer, [desc], [local], ReadBatch.of([(0, offset, 0, 0, n)]))
            with pytest.raises(WireError, match="refused"):
                t.read(prep, timeout=10.0)
            assert (dst == GARBAGE).all(), f"a refused read (offset {offset}, {n} bytes) wrote bytes"


# -- a store that lies about slot fences ----------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("verify", [True, False])
def test_lying_fence_does_not_commit_a_torn_version(tmp_path, verify: bool) -> None:
    """A store that resets a slot's fence while the slot is overwritten under a reader defeats the
    store-side fence check; the slot stamp read from the publisher's memory after the data still
    catches the overwrite, verified or not: the torn read is dropped and a later version is pulled
    bit-exactly."""
    from concurrent.futures import ThreadPoolExecutor

    from wbridge.testing.faults import inject, wrapper

    from .actors import FaultPub, release, wait_paused

    store = open_store(f"tcp://127.0.0.1:{free_port()}", host_store=True)
    pub = Worker(
        "pub",
        FaultPub,
        store.url,
        0,
        1,
        1,
        model_kind="tiny",
        mode=Async(max_staleness=100),
        transport="tcp",
        staging=Staging(checksums=True),
    )
    paused, go = str(tmp_path / "paused"), str(tmp_path / "go")
    tensors = make_tensors(ModelConfig.tiny(), 1, 0, fused=False, fill_value=GARBAGE)
    sub = Subscriber(
        "t",
        store.url,
        token=TOKEN,
        transport="tcp",
        verify=verify,
        staged=True,
    )
    inject(sub, wrapper("pause", signal_path=paused, release_path=go, on_reads=(1,)))
    sub.register(tensors)
    keys = Keys("t", generation.current(ChannelStore(store, Keys("t"), TOKEN_B)))  # this store's, not the fixture's
    try:
        pub.call("publish", 1)
        pub.call("publish", 2)  # slot 0
        rec = body(store.get(keys.version))
        assert (rec["v"], rec["slot"]) == (2, 0)
        with ThreadPoolExecutor(1) as pool:
            pulling = pool.submit(sub.pull, None, 30.0)
            wait_paused(paused, 1)  # half of version 2 read
            pub.call("publish", 3)
            pub.call("publish", 4)  # slot 0 again: version 2's bytes are gone
            store.set(keys.fence(0), str(rec["fence"]).encode())  # the lie: "slot 0 unchanged"
            release(go)
            # The stamps in the publisher's memory expose the lie: version 2 is dropped as stale.
            # (Version 4 then fails the lying fence too; version 5, in the other slot, is clean.)
            pub.call("publish", 5)
            got = pulling.result(60)
        assert got == 5 and sub.stats.last.retries >= 1, (got, sub.stats.last)
        assert mismatches(tensors, 5) == [], "a pull across a lying fence committed a mix of versions"
    finally:
        sub.close()
        pub.stop()
        store.close()
