"""Round 4's red team (#36), defects 5 and 8, in separate processes: a trainer given a wildcard host
listens nowhere and says why; listening on every interface is an explicit tcp option; bad transport
arguments are refused where they are written, before a subscriber joins or a publisher serves.
Listening sockets are read from the kernel (``/proc/<pid>/net/tcp``), not from the code's intent."""

from __future__ import annotations

import socket

import pytest

from tests.transports.engine_checks import listening_addresses

from .actors import PubActor, SubActor
from .harness import Worker, WorkerError, free_port

pytestmark = pytest.mark.timeout(180)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_wildcard_host_refused_in_a_trainer_process() -> None:
    """``Publisher(host="")`` (an unset environment variable, say) in a trainer process: a
    ``UsageError`` naming the host, and nothing listens: not the tcp transport on 0.0.0.0, not the
    store it was to host."""
    port = free_port()
    worker = None
    try:
        with pytest.raises(WorkerError) as refused:
            worker = Worker(
                "pub", PubActor, f"tcp://127.0.0.1:{port}", 0, 1, 1, host_store=True, model_kind="tiny", host=""
            )
            worker.call("publish", 1)
            pytest.fail(f"Publisher(host='') served; the trainer listens on {listening_addresses(worker.proc.pid)}")
        assert refused.value.exc_type == "UsageError" and "wildcard" in str(refused.value), refused.value
        assert _port_is_free(port), "the store was hosted before the host was checked"
    finally:
        if worker is not None:
            worker.stop()


def test_bind_all_listens_on_every_interface_and_advertises_host() -> None:
    """The documented opt-in, ``transport_options={"tcp": {"bind_all": True}}``: the trainer's tcp
    listener is on 0.0.0.0 (the store stays on the host given), its endpoint names ``host``, and a
    subscriber in another process pulls through it, bit-exact."""
    url = f"tcp://127.0.0.1:{free_port()}"
    opts = {"tcp": {"bind_all": True}}
    pub = Worker(
        "pub", PubActor, url, 0, 1, 1, host_store=True, model_kind="tiny", transport="tcp", transport_options=opts
    )
    sub = None
    try:
        pub.call("publish", 1)
        listening = listening_addresses(pub.proc.pid)
        store_port = int(url.rsplit(":", 1)[1])
        assert ("127.0.0.1", store_port) in listening, listening
        assert [a for a, p in listening if p != store_port] == ["0.0.0.0"], listening
        sub = Worker("sub", SubActor, url, 1, 0, model_kind="tiny", fused=False, transport="tcp")
        got = sub.call("pull", min_version=1)
        assert got["v"] == 1 and got["bad"] == [] and got["transports"], got
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"transport_options": {"tcp": 5}}, "transport_options"),
        ({"transport": ["tcp"]}, "transport"),
        ({"transport_options": {"tcp": {"streams": "4"}}}, "streams"),
        ({"transport_options": {"bogus": {}}}, "bogus"),
    ],
)
def test_bad_subscriber_arguments_refused_before_it_joins(kwargs: dict, word: str) -> None:
    """A rollout process built with bad transport arguments fails at construction with a
    ``UsageError`` naming them (before round 4: at its first pull, or never), and the trainer never
    counts it as a subscriber."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("pub", PubActor, url, 0, 1, 1, host_store=True, model_kind="tiny", mode="sync", transport="tcp")
    sub = None
    try:
        pub.call("publish", 1)
        with pytest.raises(WorkerError) as refused:
            sub = Worker("sub", SubActor, url, 1, 0, model_kind="tiny", fused=False, **kwargs)
            sub.call("pull", min_version=1)
        assert refused.value.exc_type == "UsageError" and word in str(refused.value), refused.value
        assert pub.call("live_subscribers") == 0
    finally:
        for w in (sub, pub):
            if w is not None:
                w.stop()


def test_bad_publisher_transport_options_refused_before_it_serves() -> None:
    """A trainer process given options for a transport that does not exist (silently ignored
    before round 4) or an option its transport does not have fails at construction, naming them,
    with nothing listening."""
    for opts, word in (
        ({"bogus": {}}, "bogus"),
        ({"tcp": {"bogus_opt": 1}}, "bogus_opt"),
        ({"tcp": {"port": "x"}}, "port"),
    ):
        port = free_port()
        with pytest.raises(WorkerError) as refused:
            Worker("pub", PubActor, f"tcp://127.0.0.1:{port}", 0, 1, 1, host_store=True, model_kind="tiny",
                   transport_options=opts).stop()  # fmt: skip
        assert refused.value.exc_type == "UsageError" and word in str(refused.value), refused.value
        assert _port_is_free(port), "the store was hosted before the options were checked"
