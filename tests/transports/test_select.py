"""Table-driven tests of the ``auto`` transport policy (``transports.select``)."""

from __future__ import annotations

import json
import sys

import pytest

import transports
from transports import MissingExtraError, TransportError
from transports.select import candidates, capabilities, choose_transport, host_identity

pytestmark = pytest.mark.timeout(60)

ALL = ["tcp", "local", "mooncake", "nixl", "nccl"]


def caps(transports=ALL, rdma=(), host="h1", nccl=False, cuda=False):
    return {"transports": list(transports), "rdma": list(rdma), "cuda": cuda, "host": host, "nccl": nccl}


IB = ["mlx5_0"]

CASES = [
    # (id, local, remote, preference, expected name, words in the reason)
    ("rdma-both-nixl", caps(rdma=IB), caps(rdma=IB, host="h2"), "auto", "nixl", "RDMA"),
    ("rdma-both-same-host-still-rdma-first", caps(rdma=IB), caps(rdma=IB), "auto", "nixl", "RDMA"),
    (
        "rdma-mooncake-only-remote",
        caps(rdma=IB),
        caps(["tcp", "mooncake"], rdma=IB, host="h2"),
        "auto",
        "mooncake",
        "mooncake on both",
    ),
    ("rdma-one-side-only", caps(rdma=IB), caps(host="h2"), "auto", "tcp", "no RDMA on both"),
    (
        "rdma-no-common-engine",
        caps(["tcp", "nixl"], rdma=IB),
        caps(["tcp", "mooncake"], rdma=IB, host="h2"),
        "auto",
        "tcp",
        "no common RDMA",
    ),
    ("same-host-local", caps(), caps(), "auto", "local", "same host"),
    ("same-host-no-local", caps(["tcp"]), caps(["tcp", "local"]), "auto", "tcp", "local unavailable"),
    ("nccl-both-opted-in", caps(nccl=True), caps(host="h2", nccl=True), "auto", "nccl", "opted in"),
    ("nccl-one-side-opted-in", caps(nccl=True), caps(host="h2"), "auto", "tcp", "different hosts"),
    ("local-beats-nccl", caps(nccl=True), caps(nccl=True), "auto", "local", "same host"),
    ("different-hosts-tcp", caps(), caps(host="h2"), "auto", "tcp", "different hosts"),
    ("requested", caps(), caps(host="h2"), "mooncake", "mooncake", "requested"),
    ("requested-local-overrides-rdma", caps(rdma=IB), caps(rdma=IB), "tcp", "tcp", "requested"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_policy_table(case):
    _, local, remote, pref, want, words = case
    name, reason = choose_transport(local, remote, pref)
    assert name == want
    assert words in reason


ERRORS = [
    ("no-common", caps(["local"]), caps(["tcp"], host="h2"), "auto", TransportError, "no common transport"),
    ("peer-lacks-requested", caps(), caps(["tcp"]), "nixl", TransportError, "peer offers only"),
    ("unknown-name", caps(), caps(), "carrier-pigeon", TransportError, "unknown transport"),
    ("bad-caps", {"transports": []}, caps(), "auto", TransportError, "lack"),
]


@pytest.mark.parametrize("case", ERRORS, ids=[c[0] for c in ERRORS])
def test_policy_errors(case):
    _, local, remote, pref, exc, words = case
    with pytest.raises(exc, match=words):
        choose_transport(local, remote, pref)


@pytest.mark.parametrize(
    "local, remote, want",
    [
        (caps(rdma=IB, nccl=True), caps(rdma=IB, nccl=True), ["nixl", "mooncake", "local", "nccl", "tcp"]),
        (caps(nccl=True), caps(host="h2", nccl=True), ["nccl", "tcp"]),
        (caps(["tcp", "local"]), caps(["tcp", "local"], host="h2"), ["tcp"]),
    ],
    ids=["everything", "nccl-then-tcp", "tcp-only"],
)
def test_candidates_in_fallback_order(local, remote, want):
    got = candidates(local, remote)
    assert [n for n, _ in got] == want and all(reason for _, reason in got)
    assert choose_transport(local, remote) == got[0]


def test_missing_extra_names_the_extra(monkeypatch):
    """A transport whose package does not import raises MissingExtraError naming the pip extra."""
    monkeypatch.setitem(sys.modules, "transports.mooncake", None)  # makes the import fail like a missing package
    with pytest.raises(MissingExtraError, match=r"wbridge\[mooncake\]"):
        choose_transport(caps(["tcp"]), caps(), "mooncake")


def test_capabilities_of_this_process_travel_as_json():
    c = capabilities(nccl=True)
    assert json.loads(json.dumps(c)) == c
    assert c["host"] == host_identity() and c["host"].count("/") == 1
    assert set(c["transports"]) == set(transports.available())
    assert c["nccl"] == ("nccl" in c["transports"])
    assert capabilities()["nccl"] is False
    # two processes of this machine pick local when both have it, whatever else is installed
    if "local" in c["transports"]:
        assert choose_transport(c, capabilities())[0] in ("local", "nixl", "mooncake")
