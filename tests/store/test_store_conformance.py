"""One conformance suite for every metadata store (tcp:// and etcd://), with real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from tests.etcd_fixture import free_port
from tests.store import _workers as W
from wbridge.errors import StoreError, WaitTimeout
from wbridge.store import Store, open_store

# Workers fork from one server that imported torch and the store once (spawning each would import
# torch anew, seconds per process on a small machine).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch.distributed", "wbridge.store", "wbridge.store.etcd", "tests.store._workers"])
# Room for a loaded 2-core machine: a bounded call ends within its timeout plus this. Timing is
# only ever bounded above (load makes a call slower, never faster); that a wait lasted its whole
# timeout is what its WaitTimeout says, and the tests where another process sets the key show a
# wait that keeps waiting.
SLACK = 5.0


def spawn(target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def join_all(procs: list[mp.Process], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not alive, f"worker processes {alive} did not finish within {timeout}s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def drain(q, n: int, timeout: float = 60) -> list:
    return [q.get(timeout=timeout) for _ in range(n)]


def eventually(probe, timeout: float, what: str):
    return Store.wait_until(lambda: probe() or None, timeout, what, poll=0.05, max_poll=0.1)


pytestmark = pytest.mark.timeout(120)


def test_a_set_is_visible_to_other_clients_once_it_returns(store_env):
    """Read-your-writes across connections: a record written then announced must be readable by
    whoever hears the announcement. (torch's TCPStore SET has no reply: without a round trip after
    it, most reads on another connection overtook a 1 MiB write, and ~1 in 1000 a small one.)"""
    s, other = store_env.open(), store_env.open()
    pad = os.urandom(1 << 20)
    rounds = 100 if store_env.kind == "tcp" else 10
    stale = []
    for i in range(rounds):
        value = b"%d:" % i + pad
        s.set("ryw", value)
        if other.get("ryw") != value:
            stale.append(i)
    assert not stale, f"{len(stale)} of {rounds} reads on another client missed the write that had returned"


def test_get_set_delete_roundtrip(store_env):
    s = store_env.open()
    values = {
        "plain": b"v1",
        "empty": b"",
        "binary": bytes(range(256)) * 4,
        "big": os.urandom(1 << 20),
        "nested/key:with.odd chars": b"\x00\xff\x00",
    }
    assert s.get("plain") is None
    for k, v in values.items():
        s.set(k, v)
    other = store_env.open()  # a second client sees the same bytes
    for k, v in values.items():
        assert other.get(k) == v, k
    s.set("plain", b"v2")
    assert other.get("plain") == b"v2"
    s.delete("plain")
    assert other.get("plain") is None
    s.delete("plain")  # deleting an absent key is fine
    assert other.get("empty") == b""


def test_compare_set_semantics(store_env):
    s = store_env.open()
    assert s.compare_set("k", None, b"a") is True
    assert s.get("k") == b"a"
    assert s.compare_set("k", None, b"b") is False  # exists: not created twice
    assert s.compare_set("k", b"x", b"b") is False  # wrong expectation
    assert s.get("k") == b"a"
    assert s.compare_set("k", b"a", b"b") is True
    assert s.get("k") == b"b"
    assert s.compare_set("absent", b"a", b"b") is False
    assert s.get("absent") is None


def test_add_counts(store_env):
    s = store_env.open()
    assert s.add("n", 5) == 5
    assert s.add("n", -2) == 3
    assert s.get_int("n") == 3
    assert s.add("n", 0) == 3
    s.set("bad", b"not a number")
    with pytest.raises(StoreError, match="bad"):
        s.get_int("bad")


def test_add_atomic_across_processes(store_env):
    n_proc, n_add = 3, 40
    q = CTX.Queue()
    procs = [spawn(W.adder, store_env.url, "ctr", n_add, q) for _ in range(n_proc)]
    results = drain(q, n_proc)
    join_all(procs)
    seen = sorted(v for r in results for v in r)
    # Every add returned a distinct value: no two processes ever saw the same old value.
    assert seen == list(range(1, n_proc * n_add + 1))
    assert store_env.open().get_int("ctr") == n_proc * n_add


def test_compare_set_exactly_one_winner(store_env):
    n_proc, keys = 3, [f"slot{i}" for i in range(25)]
    q, go = CTX.Queue(), CTX.Event()
    procs = [spawn(W.claimer, store_env.url, keys, f"p{i}".encode(), go, q) for i in range(n_proc)]
    time.sleep(0.2)  # not an assertion: lets the workers connect so that they race for real
    go.set()
    results = drain(q, n_proc)
    join_all(procs)
    s = store_env.open()
    winners = {}
    for ident, won in results:
        for k in won:
            assert k not in winners, f"{k} claimed by both {winners[k]} and {ident}"
            winners[k] = ident
    assert sorted(winners) == sorted(keys)
    for k, ident in winners.items():
        assert s.get(k) == ident


def test_compare_set_counter_across_processes(store_env):
    n_proc, n = 3, 25
    q = CTX.Queue()
    procs = [spawn(W.cas_incrementer, store_env.url, "cas", n, q) for _ in range(n_proc)]
    assert drain(q, n_proc) == [n] * n_proc
    join_all(procs)
    assert int(store_env.open().get("cas").split(b":")[0]) == n_proc * n


@pytest.mark.parametrize("timeout", [0.3, 1.0])
def test_wait_timeout_is_bounded(store_env, timeout):
    s = store_env.open()
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=rf"after {timeout:.1f}s .*missing"):
        s.wait("missing", timeout)
    took = time.monotonic() - t0
    assert took <= timeout + SLACK, took
    s.set("here", b"1")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=rf"after {timeout:.1f}s"):
        s.wait_change("here", b"1", timeout)
    took = time.monotonic() - t0
    assert took <= timeout + SLACK, took
    assert s.wait("here", timeout) == b"1"  # present: no wait
    assert s.wait_change("here", b"0", timeout) == b"1"


def test_wait_and_wait_change_see_another_process(store_env):
    s = store_env.open()
    go, q = CTX.Queue(), CTX.Queue()
    proc = spawn(W.setter, store_env.url, "v", [b"1", b"2", b"2", None, b"3"], go, q)
    assert q.get(timeout=60) == "ready"
    go.put(1)
    assert s.wait("v", 20) == b"1"
    go.put(1)
    assert s.wait_change("v", b"1", 20) == b"2"
    go.put(1)  # the same value again is no change: this wait must not return it
    go.put(1)  # ... but the delete is
    assert s.wait_change("v", b"2", 20) is None
    go.put(1)
    assert s.wait_change("v", None, 20) == b"3"
    join_all([proc])


def test_wait_change_wakes_promptly(store_env):
    """A waiter blocked in wait_change wakes soon after a write, well before its timeout."""
    s, writer = store_env.open(), store_env.open()
    s.set("x", b"old")
    got, t_set = {}, {}

    def wait():
        got["v"] = s.wait_change("x", b"old", 30)
        got["t"] = time.monotonic()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)  # not an assertion: lets the waiter block first
    t_set["t"] = time.monotonic()
    writer.set("x", b"new")
    t.join(30)
    assert not t.is_alive()
    assert got["v"] == b"new"
    assert got["t"] - t_set["t"] < 5.0


@pytest.mark.slow
def test_lease_alive_then_lapses_after_sigkill(store_env):
    ttl = 2.0
    s = store_env.open()
    q = CTX.Queue()
    holder = spawn(W.lease_holder, store_env.url, "live/holder", ttl, q)
    try:
        assert q.get(timeout=60) == "leased"
        # Alive, and stays alive past several TTLs while the holder keeps refreshing it.
        t_end = time.monotonic() + 2.5 * ttl
        while time.monotonic() < t_end:
            assert s.is_alive("live/holder", ttl)
            time.sleep(0.25)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        eventually(lambda: not s.is_alive("live/holder", ttl), 3 * ttl + SLACK, "the lease to lapse")
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(5)


def test_lease_revoke(store_env):
    s = store_env.open()
    lease = s.lease("live/me", 2.0)
    assert s.is_alive("live/me", 2.0)
    assert "live/me" in repr(lease)
    lease.revoke()
    lease.revoke()  # idempotent
    assert not s.is_alive("live/me", 2.0)
    assert not s.is_alive("live/never", 2.0)


def test_unreachable_store_raises_within_connect_timeout(store_env):
    port = free_port()  # nothing listens there
    url = f"{store_env.kind}://127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="unreachable"):
        open_store(url, connect_timeout=1.0)
    assert time.monotonic() - t0 <= 1.0 + SLACK


def test_closed_store_refuses(store_env):
    s = store_env.open()
    s.set("k", b"v")
    s.close()
    s.close()  # idempotent
    assert "closed=True" in repr(s)
    with pytest.raises(StoreError, match="closed"):
        s.get("k")


def test_get_many_in_order_with_absent_keys(store_env):
    """get_many answers every key in order, absent ones as None, across the etcd transaction
    limit (128 operations) and for keys all present (TCPStore's multi_get path) or not."""
    s, other = store_env.open(), store_env.open()
    keys = [f"many/{i}" for i in range(300)]
    for i, k in enumerate(keys):
        if i % 3:
            s.set(k, b"v%d" % i)
    s.set("many/empty", b"")
    s.set("many/big", os.urandom(1 << 16))
    got = other.get_many(keys)
    assert got == [None if i % 3 == 0 else b"v%d" % i for i in range(len(keys))]
    present = [k for i, k in enumerate(keys) if i % 3] + ["many/empty", "many/big"]
    assert other.get_many(present) == [s.get(k) for k in present]
    assert other.get_many([]) == []
    assert other.get_many(["nothing/here"]) == [None]
    # the connection is still good after the fallback path
    assert other.get("many/1") == b"v1"


def test_delete_many(store_env):
    s, other = store_env.open(), store_env.open()
    keys = [f"del/{i}" for i in range(200)]
    for k in keys[:150]:
        s.set(k, b"x")
    s.set("keep", b"k")
    s.delete_many(keys)  # 50 of them were never there
    assert other.get_many(keys) == [None] * len(keys)
    assert other.get("keep") == b"k"
    s.delete_many([])


def test_wait_blocks_until_the_key_appears_and_other_calls_go_on(store_env):
    """wait blocks in the store (no polling needed) and wakes soon after another client writes the
    key; meanwhile the same client's other calls are not held up behind it."""
    s, writer = store_env.open(), store_env.open()
    s.set("other", b"o")
    got = {}

    def wait():
        got["v"] = s.wait("appears", 30)
        got["t"] = time.monotonic()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)  # not an assertion: lets the waiter block first
    t0 = time.monotonic()
    assert s.get("other") == b"o"
    assert s.get_many(["other", "appears"]) == [b"o", None]
    assert time.monotonic() - t0 < 5.0, "a call waited behind the blocking wait"
    t_set = time.monotonic()
    writer.set("appears", b"now")
    t.join(30)
    assert not t.is_alive()
    assert got["v"] == b"now"
    assert got["t"] - t_set < 5.0
