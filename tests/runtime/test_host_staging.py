"""Host staging's decisions, on any machine: where a publisher's slots and a subscriber's reads live
for tensors on a device, given the memory the transports reach (``wbridge._selection``). Device
names are only strings here, so these run without a GPU; the copies they lead to run in
``scripts/gpu_check.sh`` (parts ``tcp``, ``local``, ``auto``, ``host_cast``)."""

from __future__ import annotations

import pytest

import transports
from transports import select
from wbridge import TransportError, UsageError
from wbridge._selection import (
    BufferPlacement,
    SlotPlacement,
    memory_kinds,
    publisher_placement,
    reaching,
    subscriber_placement,
)
from wbridge.pull.context import Endpoints

KINDS = memory_kinds(list(transports.REGISTRY))  # the transports' own declarations
WHO = "rank 0"


def kinds(*names: str) -> dict[str, tuple[str, ...]]:
    return {n: KINDS[n] for n in names}


def test_transports_declare_the_memory_they_reach() -> None:
    assert {n: KINDS[n] for n in ("tcp", "local", "nccl")} == {
        "tcp": ("cpu",),
        "local": ("cpu",),
        "nccl": ("cpu", "cuda"),
    }
    if "nixl" in KINDS:
        assert KINDS["nixl"] == ("cpu", "cuda")
    if "mooncake" in KINDS:  # registers host memory only (transports._util.check_host_memory)
        assert KINDS["mooncake"] == ("cpu",)
    assert reaching(kinds("tcp", "local", "nccl"), "cuda:3") == ["nccl"]
    assert reaching(kinds("tcp", "local", "nccl"), "cpu") == ["tcp", "local", "nccl"]


@pytest.mark.parametrize(
    ("device", "served", "auto", "want"),
    [
        ("cpu", ("tcp", "local"), True, SlotPlacement("cpu", ("tcp", "local"))),
        # auto without RDMA: tcp and local only, neither reaches the GPU: host slots for both
        ("cuda:0", ("tcp", "local"), True, SlotPlacement("cpu", ("tcp", "local"))),
        ("cuda:1", ("tcp",), False, SlotPlacement("cpu", ("tcp",))),
        ("cuda:0", ("local",), False, SlotPlacement("cpu", ("local",))),
        # every served transport reaches the GPU: slots stay there
        ("cuda:0", ("nccl",), False, SlotPlacement("cuda:0", ("nccl",))),
        # a named mix: every named transport serves, so all from host slots
        ("cuda:0", ("tcp", "nccl"), False, SlotPlacement("cpu", ("tcp", "nccl"))),
    ],
)
def test_publisher_slots(device, served, auto, want) -> None:
    assert publisher_placement(device, kinds(*served), auto=auto, zero_copy=False, who=WHO) == want


@pytest.mark.skipif("nixl" not in KINDS, reason="nixl is not installed")
def test_publisher_auto_with_rdma_serves_device_slots_through_nixl_only() -> None:
    """auto where RDMA devices exist serves tcp, local, nixl, mooncake: the slots stay on the GPU
    and only what reaches it serves them (GPUDirect reads), not a host copy for all."""
    served = kinds(*[n for n in ("tcp", "local", "nixl", "mooncake") if n in KINDS])
    got = publisher_placement("cuda:0", served, auto=True, zero_copy=False, who=WHO)
    assert got == SlotPlacement("cuda:0", ("nixl",))
    zero = publisher_placement("cuda:0", served, auto=True, zero_copy=True, who=WHO)
    assert zero == SlotPlacement("cuda:0", ("nixl",))
    # named, the same transports are all served: from host slots
    named = publisher_placement("cuda:0", served, auto=False, zero_copy=False, who=WHO)
    assert named == SlotPlacement("cpu", tuple(served))


@pytest.mark.parametrize("auto", [True, False])
def test_publisher_zero_copy_of_gpu_tensors_needs_a_transport_that_reaches_them(auto) -> None:
    with pytest.raises(UsageError, match=r"rank 0: staging=ZeroCopy\(\).*cuda:0.*tcp, local.*Staging\(\)"):
        publisher_placement("cuda:0", kinds("tcp", "local"), auto=auto, zero_copy=True, who=WHO)
    assert publisher_placement("cpu", kinds("tcp"), auto=auto, zero_copy=True, who=WHO) == SlotPlacement(
        "cpu", ("tcp",)
    )


@pytest.mark.parametrize(
    ("device", "preference", "staged", "rdma", "want"),
    [
        ("cpu", "tcp", False, False, BufferPlacement("cpu", False)),
        ("cpu", "auto", True, True, BufferPlacement("cpu", True)),
        # a named transport that reaches host memory only: through a host buffer when staged
        ("cuda:0", "tcp", True, False, BufferPlacement("cpu", True)),
        ("cuda:2", "local", True, True, BufferPlacement("cpu", True)),
        # a named transport that reaches the GPU: as asked
        ("cuda:0", "nccl", False, False, BufferPlacement("cuda:0", False)),
        ("cuda:0", "nccl", True, False, BufferPlacement("cuda:0", True)),
        # auto without RDMA here: tcp or local will be chosen: staged through host memory
        ("cuda:0", "auto", False, False, BufferPlacement("cpu", True)),
        ("cuda:0", "auto", True, False, BufferPlacement("cpu", True)),
    ],
)
def test_subscriber_buffers(device, preference, staged, rdma, want) -> None:
    installed = kinds("tcp", "local", "nccl")
    assert subscriber_placement(device, preference, staged, installed, rdma, WHO) == want


def test_subscriber_auto_reads_device_memory_where_nixl_and_rdma_are() -> None:
    nixl = {**kinds("tcp", "local", "nccl"), "nixl": ("cpu", "cuda")}
    assert subscriber_placement("cuda:0", "auto", False, nixl, True, WHO) == BufferPlacement("cuda:0", False)
    assert subscriber_placement("cuda:0", "auto", False, nixl, False, WHO) == BufferPlacement("cpu", True)
    mooncake = {**kinds("tcp", "local"), "mooncake": ("cpu",)}  # RDMA, but it reaches host memory only
    assert subscriber_placement("cuda:0", "auto", False, mooncake, True, WHO) == BufferPlacement("cpu", True)


def test_a_relay_serving_tcp_and_local_stages_in_host_memory() -> None:
    """A relay under ``auto`` serves its buffer on tcp and local: host memory even where nixl could
    read into the GPU; a relay that names nixl serves it from the GPU."""
    nixl = {**kinds("tcp", "local"), "nixl": ("cpu", "cuda")}
    relay = ("tcp", "local")
    assert subscriber_placement("cuda:0", "auto", True, nixl, True, WHO, relay) == BufferPlacement("cpu", True)
    assert subscriber_placement("cuda:0", "nixl", True, nixl, True, WHO, ["nixl"]) == BufferPlacement("cuda:0", True)


def test_subscriber_direct_reads_of_gpu_tensors_through_tcp_are_refused() -> None:
    with pytest.raises(UsageError, match=r"rank 0: the tensors are on cuda:1, but transport 'tcp'.*staged=True"):
        subscriber_placement("cuda:1", "tcp", False, kinds("tcp", "nccl"), False, WHO)
    # a transport not installed here is left to connecting, which names its extra
    assert subscriber_placement("cuda:0", "nixl", False, kinds("tcp"), True, WHO) == BufferPlacement("cuda:0", False)


def test_a_reader_on_device_memory_offers_only_the_transports_that_reach_it() -> None:
    """``Endpoints.bind``: buffers on a GPU narrow the transports ``auto`` chooses among, and a
    publisher that serves none of them is refused with a message naming the memory."""
    ends = Endpoints(None, "127.0.0.1", {}, "auto")
    publisher = select.capabilities(transports=["tcp", "local"])
    ends.bind([], "cpu")
    assert ends.caps == ends.installed
    assert select.choose_transport(ends.caps, publisher)[0] == "local"
    ends.bind([], "cuda:0")
    assert set(ends.caps["transports"]) == set(reaching(memory_kinds(ends.installed["transports"]), "cuda"))
    assert "tcp" not in ends.caps["transports"] and "local" not in ends.caps["transports"]
    with pytest.raises(TransportError, match="reaching its cuda memory"):
        select.choose_transport(ends.caps, publisher)
    ends.close()
