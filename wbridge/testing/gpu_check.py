"""The GPU path in one run (``bash scripts/gpu_check.sh``): the Publisher/Subscriber runtime on CUDA
tensors on both sides, every byte checked against a reference computed on the CPU, then the device
figures. Under 5 minutes on one CUDA GPU; needs nothing beyond ``scripts/setup.sh``.

Parts (each prints one line ``gpu_check: ok|FAIL|SKIP <part>: <detail>``; each runs its publisher in
a process of its own and the subscriber in this one, every call bounded by a timeout). A part whose
package is missing here (nixl-cu12, vLLM's CUDA build; numba for ``delta`` and ``figures``) is a SKIP
that says so; the others run:

- ``nixl``, ``nccl``, ``tcp``, ``local``: two versions of a tiny Llama (trainer layout: one rank,
  separate q/k/v) pulled into a fused TP-rank layout through that transport. nccl needs a second
  GPU (NCCL refuses two ranks on one device), so on one GPU its line is a SKIP. tcp and local
  reach host memory only (``Transport.memory_kinds``): on CUDA tensors they go through host
  staging on both sides (the publisher's slots in pinned host memory, a staged subscriber reading
  into a pinned host buffer), and a subscriber asking for direct reads is refused (``UsageError``).
- ``auto``: ``transport="auto"`` on both sides with a direct subscriber: host staging chosen by
  both sides where no RDMA device is (the line names the transport used and why).
- ``cast_bf16``, ``fp8_block128``, ``delta``, ``packed``, ``staged`` read through nixl where it is
  installed; without it, on a GPU, through tcp with host staging on both sides (the line says so).
- ``cast_bf16``: fp32 masters registered with ``dtype=torch.bfloat16``, the cast done by the
  snapshot on the device; checked against ``tensor.to(torch.bfloat16)`` on the CPU. ``host_cast``:
  the same through tcp, so on CUDA the cast lands in the device buffer of host staging first.
- ``fp8_block128``: ``transforms={name: "fp8_block128"}`` quantised on the device; checked against
  a block-by-block quantiser on the CPU (``gpu_check_data.fp8_reference``).
- ``delta``: ``staging=Staging(delta=Delta())``; a sparse change pulled as a delta (``stats.last.delta``).
- ``packed``: a reader that joins after version 1 plans ordinary reads of the plain slot, then reads
  version 2 from the slot packed for its layout with fewer reads.
- ``staged``: a ``staged=True`` subscriber (private buffer, committed after every read).
- ``zero_copy``: a ``staging=ZeroCopy()`` publisher read straight into a direct subscriber's tensors
  (on a GPU it needs nixl: no other transport here reaches device memory).
- ``vllm`` (run last, with what is left of the budget): the real vLLM engine test where vLLM's CUDA
  build is installed; a SKIP otherwise (``setup.sh`` installs the CPU build; with no registry on
  the GPU machine that is the usual line).
- ``figures``: a large bf16 tensor through nixl with deltas (``Staging(delta=...)``): the publisher's stall (its
  snapshot copy) against ``torch``'s device-to-device copy of the same bytes in that process, the
  full-pull read bandwidth against that copy in the reading process, and the delta encode (with the
  slot's checksums: ``PublishStats.delta_s``) in GB per second. On a GPU without nixl a SKIP: host
  staging would measure the host copy, not device memory.

The last line is ``gpu_check: ok parts=<n> failed=0 stall_vs_d2d=<r> vram_read_vs_d2d=<r>
delta_encode_gbps=<x>`` (``n``: parts run, SKIPs not counted), or ``gpu_check: FAILED`` with the
same fields and exit status 1. Where no CUDA GPU exists, or no python with torch
(``scripts/gpu_check.sh`` looks for one): ``gpu_check: SKIP: <why>``, exit 0.

The same part functions run in the test suite with ``device="cpu"`` (``tests/runtime/
test_gpu_check.py``), so the references cannot rot. What only a GPU run exercises:

1. the snapshot copy on the publisher's own CUDA stream after the caller's event
   (``publish.staging.snapshot``, ``publish.staging.writes_end``), and the cast and FP8 kernels on the device;
2. the packed copy as torch strided views (``publish.packing.copy_torch``);
3. the delta scan in torch (``publish.delta.DeltaRing.encode``'s GPU branch: ``publish.delta.scan``,
   its changed pairs then coded on the host by ``protocol.delta.encode``), its checksums through a
   host copy (``protocol.checksum.host_array``), and the delta scatter into CUDA memory
   (``pull.delta_reads.apply``);
4. nixl's VRAM registrations and NCCL process groups on CUDA memory (``transports._nccl_group``),
   and the staged subscriber's commit as device copies (``_tensors.commit_pairs``);
5. host staging (tcp, local, auto without RDMA): pinned host memory (``_tensors.alloc_bytes(pinned=
   True)``) for the publisher's slots and the subscriber's read buffer; the publisher's device
   buffer (``Registration.bounce``) that the snapshot copies, casts, transforms or packs into, and
   its one device-to-host copy into the slot (``publish.staging.snapshot``); the subscriber's
   commit from host to device (``_tensors.commit_pairs`` with mixed devices, ``pull.apply``); and
   the refusal of a direct subscriber (``refuses_direct``). The decisions themselves
   (``_selection.publisher_placement``, ``subscriber_placement``, ``Endpoints.bind`` narrowing a
   reader's transports) are pure and run in ``tests/runtime/test_host_staging.py`` on any machine.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..options import Async, Delta, Staging, ZeroCopy
from .gpu_check_data import differing, garbage_like, publisher_tensors, subscriber_tensors

CHANNEL = "gpu-check"
TOKEN = "gpu-check-token"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PART_TIMEOUT = 90.0  # seconds for one part's calls (a loaded 2-core CI machine needs most of it)
BUDGET_S = 270.0  # the whole run; scripts/gpu_check.sh kills it at 280 s
FIGURE_BYTES = {"cuda": 1 << 30, "cpu": 8 << 20}  # the figures' tensor


@dataclass(frozen=True)
class PartResult:
    """One part's outcome: ``status`` ``ok``, ``FAIL`` or ``SKIP``, and one line of detail."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"gpu_check: {self.status} {self.name}: {self.detail}"


# ------------------------------------------------------------------------------------------------
# Construction: every Publisher and Subscriber of the check is built by these two functions.


def make_publisher(url: str, transport: str | list[str], **options: Any):
    """Rank 0 of 1 (hosting the store) with the part's options (``staging=``, ``mode=``...)."""
    from wbridge import Publisher

    return Publisher(CHANNEL, url, rank=0, world_size=1, host_store=True, token=TOKEN, transport=transport, **options)


def make_subscriber(url: str, transport: str, **options: Any):
    from wbridge import Subscriber

    return Subscriber(CHANNEL, url, token=TOKEN, transport=transport, **options)


# ------------------------------------------------------------------------------------------------
# The publisher's process


class PublisherProcess:
    """A part's publisher, in a worker process (``wbridge.testing.workers.Worker``).

    - ``url``: the store it hosts. ``transport``: what it serves.
    - ``source``, ``nbytes``: its tensors (``publisher_tensors``), moved to ``device``.
    - ``options``: Publisher keywords (``staging``, ``mode``...).
    - ``register``: ``register()`` keywords (``dtype``, ``transforms``).
    """

    def __init__(
        self,
        url: str,
        transport: str | list[str],
        source: str,
        device: str,
        options: dict,
        register: dict,
        nbytes: int = 0,
    ) -> None:
        self.source, self.device, self.nbytes = source, device, nbytes
        self.tensors = {n: (t.to(device), d) for n, (t, d) in publisher_tensors(source, 0, nbytes).items()}
        self.pub = make_publisher(url, transport, **options)
        self.pub.register(self.tensors, **register)

    def publish(self, v: int, timeout: float = PART_TIMEOUT) -> dict:
        for n, (t, _) in publisher_tensors(self.source, v, self.nbytes).items():
            self.tensors[n][0].copy_(t)  # a training step's write, on the caller's stream
        got = self.pub.publish(timeout=timeout)
        s = self.pub.stats.last
        return {"v": got, "stall_s": s.stall_s, "delta_s": s.delta_s, "nbytes": s.nbytes}

    def device_copy_s(self, nbytes: int, repeat: int = 5) -> float:
        return device_copy_s(nbytes, self.device, repeat)

    def close(self) -> None:
        self.pub.close()


def device_copy_s(nbytes: int, device: str, repeat: int = 5) -> float:
    """Median seconds of ``torch``'s copy of ``nbytes`` between two buffers on ``device`` (on the
    host a numpy memcpy, as the host snapshot copies: torch's uint8 ``copy_`` is slower there)."""
    import numpy as np
    import torch

    a = torch.ones(nbytes, dtype=torch.uint8, device=device)
    b = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if device == "cpu":
        sync, copy = (lambda: None), functools.partial(np.copyto, b.numpy(), a.numpy())
    else:
        sync, copy = torch.cuda.synchronize, functools.partial(b.copy_, a)
    times = []
    for i in range(repeat + 1):
        sync()
        t0 = time.perf_counter()
        copy()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _context() -> Any:
    """forkserver: one process imports torch and wbridge once, each publisher is a cheap fork of it
    (it never touches CUDA, so the forks may)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "wbridge", "wbridge.testing.synthetic", __name__])
    return ctx


def _free_port() -> int:
    from transports._util import free_port

    return free_port()


class Session:
    """One part's publisher process and subscriber (in this process), torn down by ``close``.

    - ``transport``: what the publisher serves and the subscriber reads through (``"auto"``: both choose).
    - ``source``, ``device``, ``nbytes``: the publisher's tensors (``publisher_tensors``) and their device.
    - ``sub_kind``: the subscriber's tensors and reference (``subscriber_tensors``).
    - ``sub_device``: where the subscriber's tensors live (default ``device``).
    - ``options``, ``register``: Publisher and ``register()`` keywords.
    - ``sub_options``: Subscriber keywords (``staged``...).
    - ``subscribe``: register the subscriber now (False: call ``subscribe()`` later).
    """

    def __init__(
        self,
        transport: str,
        source: str,
        device: str,
        *,
        sub_kind: str,
        sub_device: str | None = None,
        options: dict | None = None,
        register: dict | None = None,
        sub_options: dict | None = None,
        nbytes: int = 0,
        subscribe: bool = True,
    ) -> None:
        from wbridge.testing.workers import Worker

        self.url = f"tcp://127.0.0.1:{_free_port()}"
        self.sub_kind, self.nbytes, self.transport = sub_kind, nbytes, transport
        self.sub_device = sub_device or device
        self.sub = None
        self.held: dict[str, tuple[Any, Any]] = {}
        self.sub_options = sub_options or {}
        served = transport if transport == "auto" else [transport]
        self.pub = Worker(
            "publisher",
            PublisherProcess,
            self.url,
            served,
            source,
            device,
            options or {},
            register or {},
            nbytes,
            timeout=PART_TIMEOUT,
            context=_context(),
        )
        if subscribe:
            self.subscribe()

    def subscribe(self) -> None:
        self.held = garbage_like(subscriber_tensors(self.sub_kind, 0, self.nbytes), self.sub_device)
        self.sub = make_subscriber(self.url, self.transport, **self.sub_options)
        self.sub.register(self.held)

    def publish(self, v: int) -> dict:
        """Publishes ``v`` and returns the publisher's figures (the call does not wait for a pull)."""
        self.pub.send("publish", v)
        return self.pub.result(PART_TIMEOUT)

    def step(self, v: int) -> tuple[dict, Any]:
        """Publishes ``v`` while pulling it (zero-copy and sync publishers wait for the ack), checks
        every byte against the CPU reference; returns the publisher's figures and the pull's stats."""
        self.pub.send("publish", v)
        got = self.sub.pull(min_version=v, timeout=PART_TIMEOUT)
        figures = self.pub.result(PART_TIMEOUT)
        if got != v or figures["v"] != v:
            raise AssertionError(f"published {figures['v']}, pulled {got}, wanted {v}")
        self.check(v)
        return figures, self.sub.stats.last

    def check(self, v: int) -> None:
        bad = differing(self.held, subscriber_tensors(self.sub_kind, v, self.nbytes))
        if bad:
            raise AssertionError(f"version {v}: bytes differ from the CPU reference in {bad}")

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()
        self.pub.stop()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _model_bytes(session: Session) -> int:
    return sum(int(t.numel()) * t.element_size() for t, _ in session.held.values())


# ------------------------------------------------------------------------------------------------
# Parts: each returns its line's detail, raises on a failure, or raises Skip.


class Skip(Exception):
    """A part that cannot run here; its message says why."""


NIXL_MISSING = "nixl-cu12 is not installed (pip install 'wbridge[nixl]')"
NUMBA_MISSING = "numba is not installed (pip install numba): the publisher's delta encoder needs it"


def need_numba() -> None:
    """A Skip where numba, which a publisher with deltas encodes with, is not installed (a bare GPU
    machine's ``python3``)."""
    import importlib.util

    if importlib.util.find_spec("numba") is None:
        raise Skip(NUMBA_MISSING)


@dataclass(frozen=True)
class Route:
    """How the feature parts read: ``transport``, whether the subscriber is ``staged`` (host staging
    on a GPU), and ``note``, what their line adds when it is not nixl's direct path."""

    transport: str
    staged: bool
    note: str = ""


def feature_route(device: str) -> Route:
    """nixl where installed (it reaches VRAM); else tcp, which on a GPU stages in host memory on
    both sides."""
    import transports

    if "nixl" in transports.available():
        return Route("nixl", False)
    if device == "cpu":
        return Route("tcp", False)
    return Route("tcp", True, " (through tcp with host staging: nixl-cu12 is not installed)")


def device_route(device: str, what: str) -> Route:
    """The route of a part that needs a transport reaching ``device`` itself; a Skip without one."""
    route = feature_route(device)
    if route.staged:
        raise Skip(f"{what} needs a transport that reaches GPU memory: {NIXL_MISSING}")
    return route


def host_only(name: str) -> bool:
    """Whether transport ``name`` reaches host memory only (``Transport.memory_kinds``): CUDA tensors
    then go through host staging on both sides (``wbridge._selection``)."""
    import transports

    return "cuda" not in transports.get(name).memory_kinds


def refuses_direct(s: Session, device: str) -> None:
    """A subscriber that asks to read straight into CUDA tensors (``staged=False``) through a
    transport that reaches host memory only gets ``UsageError`` from ``register``."""
    from wbridge import UsageError

    sub = make_subscriber(s.url, s.transport, staged=False)
    try:
        sub.register(garbage_like(subscriber_tensors(s.sub_kind, 0, s.nbytes), device))
    except UsageError as e:
        if s.transport not in str(e) or "staged=True" not in str(e):
            raise AssertionError(f"the refusal does not name the transport and the remedy: {e}") from None
        return
    finally:
        sub.close()
    raise AssertionError(f"a direct subscriber on {device} through {s.transport} registered")


def transport_part(name: str) -> Callable[[str], str]:
    def part(device: str) -> str:
        import torch

        import transports

        if name not in transports.available():
            raise Skip(NIXL_MISSING if name == "nixl" else f"transport {name} is not usable here")
        sub_device = device
        if name == "nccl" and device != "cpu":
            if torch.cuda.device_count() < 2:
                raise Skip("NCCL refuses two ranks on one device: needs a second GPU (subscriber on cuda:1)")
            sub_device = "cuda:1"
        # host memory only: the publisher stages in host memory by itself, the subscriber is staged
        staged = host_only(name)
        s = Session(name, "model", device, sub_kind="model", sub_device=sub_device, sub_options={"staged": staged})
        try:
            if staged and device != "cpu":
                refuses_direct(s, device)
            for v in (1, 2):
                s.step(v)
            used = s.sub.stats.transports[0][0]
            if used != name:
                raise AssertionError(f"read through {used}, not {name}")
            how = ", host staging on both sides" if staged and device != "cpu" else ""
            return f"{_mib(_model_bytes(s))} x 2 versions bit-exact through {name} ({device} -> {sub_device}{how})"
        finally:
            s.close()

    part.__name__ = f"part_{name}"
    return part


def part_auto(device: str) -> str:
    """``transport="auto"`` on both sides and a direct subscriber: on a GPU without RDMA both sides
    stage in host memory by themselves (tcp and local reach host memory only); with RDMA devices and
    nixl both read device memory through nixl."""
    s = Session("auto", "model", device, sub_kind="model")
    try:
        for v in (1, 2):
            s.step(v)
        used, reason = s.sub.stats.transports[0]
        return f"{_mib(_model_bytes(s))} x 2 versions bit-exact, auto on both sides chose {used} ({reason})"
    finally:
        s.close()


def part_cast_bf16(device: str) -> str:
    import torch

    r = feature_route(device)
    register = {"dtype": torch.bfloat16}
    s = Session(r.transport, "fp32", device, sub_kind="bf16", register=register, sub_options={"staged": r.staged})
    try:
        for v in (1, 2):
            s.step(v)
        return "fp32 masters cast to bf16 by the snapshot, 2 versions equal tensor.to(bfloat16) on the CPU" + r.note
    finally:
        s.close()


def part_host_cast(device: str) -> str:
    """The bf16 cast through tcp: on CUDA tensors computed on the device, then copied to the
    publisher's host slot; the staged subscriber copies it to its device tensors."""
    import torch

    register = {"dtype": torch.bfloat16}
    s = Session("tcp", "fp32", device, sub_kind="bf16", register=register, sub_options={"staged": True})
    try:
        for v in (1, 2):
            s.step(v)
        return "fp32 masters cast to bf16 by the snapshot, through tcp (host staging on CUDA): 2 versions bit-exact"
    finally:
        s.close()


def part_fp8_block128(device: str) -> str:
    transforms = {n: "fp8_block128" for n in ("a.weight", "b.weight")}
    r = feature_route(device)
    register = {"transforms": transforms}
    s = Session(r.transport, "fp32", device, sub_kind="fp8", register=register, sub_options={"staged": r.staged})
    try:
        for v in (1, 2):
            s.step(v)
        if not bool((s.held["a.weight_scale_inv"][0][1, 0] == 1.0).all()):
            raise AssertionError("the all-zero block's scale_inv is not 1.0")
        return (
            "2 weights (edge blocks, a zero block) quantised by the snapshot equal the CPU quantiser, 2 versions"
            + r.note
        )
    finally:
        s.close()


def part_delta(device: str) -> str:
    need_numba()
    r = feature_route(device)
    s = Session(
        r.transport,
        "sparse",
        device,
        sub_kind="sparse",
        options={"staging": Staging(delta=Delta())},
        sub_options={"staged": r.staged},
        nbytes=1 << 20,
    )
    try:
        _, first = s.step(1)
        _, second = s.step(2)
        if first.delta or not second.delta:
            raise AssertionError(f"delta flags of the two pulls: {first.delta}, {second.delta} (want False, True)")
        if second.nbytes >= first.nbytes:
            raise AssertionError(f"the delta pull read {second.nbytes} bytes, the full one {first.nbytes}")
        return f"version 2 pulled as a delta ({second.nbytes} of {first.nbytes} bytes), bit-exact{r.note}"
    finally:
        s.close()


def part_packed(device: str) -> str:
    r = feature_route(device)
    s = Session(r.transport, "model", device, sub_kind="model", sub_options={"staged": r.staged}, subscribe=False)
    try:
        s.publish(1)  # no reader yet: the plain slot
        s.subscribe()
        s.sub.pull(min_version=1, timeout=PART_TIMEOUT)
        s.check(1)
        plain = s.sub.stats.last.ops
        _, packed = s.step(2)  # packed for the reader's layout announced since
        if packed.ops >= plain:
            raise AssertionError(f"{packed.ops} reads from the packed slot, {plain} from the plain one")
        return f"reader-ordered slot: {packed.ops} reads against {plain} from the plain slot, bit-exact{r.note}"
    finally:
        s.close()


def part_staged(device: str) -> str:
    r = feature_route(device)
    s = Session(r.transport, "model", device, sub_kind="model", sub_options={"staged": True})
    try:
        for v in (1, 2):
            s.step(v)
        return "staged subscriber (private buffer, committed after the reads): 2 versions bit-exact" + r.note
    finally:
        s.close()


def part_zero_copy(device: str) -> str:
    r = device_route(device, "a zero-copy publisher")
    s = Session(r.transport, "model", device, sub_kind="model", options={"staging": ZeroCopy()})
    try:
        for v in (1, 2):
            s.step(v)
        return "zero-copy publisher read straight into the subscriber's tensors: 2 versions bit-exact"
    finally:
        s.close()


def vllm_python() -> str | None:
    """The vLLM venv's python (``scripts/setup.sh``), where it exists."""
    py = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    return py if os.access(py, os.X_OK) else None


def part_vllm(device: str, budget_s: float = 200.0) -> str:
    """``budget_s``: seconds left for it (the probe, then the engine test)."""
    if device == "cpu":
        raise Skip("the CPU-free path is vLLM's CUDA engine; CPU runs are the vLLM tests' job")
    py = vllm_python()
    if py is None:
        raise Skip("no .venv-vllm (scripts/setup.sh with WBRIDGE_SKIP_VLLM=1?)")
    t0 = time.monotonic()
    probe = "from vllm.platforms import current_platform as p; print(p.device_type)"
    got = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=min(60.0, budget_s))
    kind = got.stdout.strip().splitlines()[-1] if got.returncode == 0 and got.stdout.strip() else "unimportable"
    if kind != "cuda":
        raise Skip(f"vLLM's CUDA build is not installed (.venv-vllm has the {kind} build setup.sh installs)")
    left = budget_s - (time.monotonic() - t0)
    if left < 60:
        raise Skip(f"vLLM's CUDA build is here but only {left:.0f} s of the budget are left for its engine test")
    test = "tests/correspondence/test_vllm_engine.py::test_vllm_pulls_perturbed_weights"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", test]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
    if run.returncode != 0:
        raise AssertionError(f"{test} failed: {run.stdout.strip().splitlines()[-1:]}")
    return f"{test} passed on vLLM's CUDA build"


@dataclass(frozen=True)
class Figures:
    stall_vs_d2d: float  # publisher stall (snapshot copy) / torch device copy of the same bytes
    vram_read_vs_d2d: float  # full-pull read GB/s / torch device copy GB/s (in the reader's process)
    delta_encode_gbps: float  # slot bytes / (delta encode + its checksums)


def measure_figures(device: str) -> tuple[Figures, str]:
    """The device figures, from a large tensor published with deltas in ``Async`` mode
    (publishes need not wait for pulls): versions 1, 3 and 5 are pulled in full (``delta_history=1``,
    two versions apart), 2 to 5 each encode a delta; every pulled byte is checked."""
    need_numba()
    nbytes = FIGURE_BYTES["cpu" if device == "cpu" else "cuda"]
    options = {"staging": Staging(delta=Delta(history=1)), "mode": Async(max_staleness=2)}
    r = device_route(device, "the VRAM read figure")
    s = Session(r.transport, "sparse", device, sub_kind="sparse", options=options, nbytes=nbytes)
    try:
        stalls, encodes, reads = [], [], []
        for v in range(1, 6):
            fig = s.publish(v)
            stalls.append(fig["stall_s"])
            if v > 1:
                encodes.append(fig["delta_s"])
            if v % 2:
                s.sub.pull(min_version=v, timeout=PART_TIMEOUT)
                s.check(v)
                last = s.sub.stats.last
                if last.delta:
                    raise AssertionError(f"version {v} was pulled as a delta; the figure needs a full pull")
                if v > 1:  # the first pull also connects and plans
                    reads.append(last.nbytes / last.seconds)
        pub_copy = s.pub.call("device_copy_s", nbytes, call_timeout=PART_TIMEOUT)
        sub_copy = device_copy_s(nbytes, s.sub_device)
        figures = Figures(
            stall_vs_d2d=statistics.median(stalls) / pub_copy,
            vram_read_vs_d2d=statistics.median(reads) / (nbytes / sub_copy),
            delta_encode_gbps=nbytes / statistics.median(encodes) / 1e9,
        )
        detail = (
            f"{_mib(nbytes)}: stall {statistics.median(stalls) * 1e3:.2f} ms vs d2d {pub_copy * 1e3:.2f} ms, "
            f"read {statistics.median(reads) / 1e9:.2f} GB/s vs d2d {nbytes / sub_copy / 1e9:.2f} GB/s, "
            f"delta encode {statistics.median(encodes) * 1e3:.2f} ms"
        )
        return figures, detail
    finally:
        s.close()


PARTS: dict[str, Callable[[str], str]] = {
    **{name: transport_part(name) for name in ("nixl", "nccl", "tcp", "local")},
    "auto": part_auto,
    "cast_bf16": part_cast_bf16,
    "host_cast": part_host_cast,
    "fp8_block128": part_fp8_block128,
    "delta": part_delta,
    "packed": part_packed,
    "staged": part_staged,
    "zero_copy": part_zero_copy,
    "vllm": part_vllm,
}


def run_part(name: str, fn: Callable[[str], Any], device: str) -> tuple[PartResult, Any]:
    """Runs one part; its result (``PartResult``) and its return value (None unless ok)."""
    try:
        value = fn(device)
    except Skip as e:
        return PartResult(name, "SKIP", str(e)), None
    except Exception as e:  # noqa: BLE001 - reported on the part's line, with where it came from
        where = traceback.extract_tb(e.__traceback__)[-1]
        lines = str(e).strip().splitlines() or [""]
        # a worker's error carries its traceback: its last line is the exception and its message
        first = lines[-1] if hasattr(e, "exc_type") else lines[0]
        what = f"{type(e).__name__}: {first}"
        return PartResult(name, "FAIL", f"{what} ({os.path.basename(where.filename)}:{where.lineno})"), None
    detail = value[1] if isinstance(value, tuple) else value
    return PartResult(name, "ok", detail), value


def summary(results: list[PartResult], figures: Figures | None) -> str:
    """The last line: ``gpu_check: ok parts=... failed=0 ...`` or ``gpu_check: FAILED ...``."""
    failed = sum(r.status == "FAIL" for r in results)
    ran = sum(r.status != "SKIP" for r in results)

    def f(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    stall = vram = enc = None
    if figures is not None:
        stall, vram, enc = figures.stall_vs_d2d, figures.vram_read_vs_d2d, figures.delta_encode_gbps
    return (
        f"gpu_check: {'FAILED' if failed else 'ok'} parts={ran} failed={failed} stall_vs_d2d={f(stall, '.2f')} "
        f"vram_read_vs_d2d={f(vram, '.3f')} delta_encode_gbps={f(enc, '.2f')}"
    )


def run(device: str, parts: list[str] | None = None, budget_s: float = BUDGET_S) -> tuple[list[PartResult], int]:
    """Runs the parts (all by default) and the figures on ``device``, printing each line as it
    ends; returns the results and the exit status. A part not started within ``budget_s`` fails."""
    deadline = time.monotonic() + budget_s
    results: list[PartResult] = []
    figures = None
    names = parts or list(PARTS)
    todo = [(n, PARTS[n]) for n in names if n != "vllm"] + [("figures", measure_figures)]
    todo += [("vllm", PARTS["vllm"])] if "vllm" in names else []  # last: it gets what is left
    for name, fn in todo:
        left = deadline - time.monotonic()
        if left <= 0:
            result, value = PartResult(name, "FAIL", f"not run: the {budget_s:.0f} s budget ran out"), None
        else:
            result, value = run_part(name, functools.partial(fn, budget_s=left) if name == "vllm" else fn, device)
        if name == "figures" and value is not None:
            figures = value[0]
        results.append(result)
        print(result.line(), flush=True)
    print(summary(results, figures), flush=True)
    return results, 1 if any(r.status == "FAIL" for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The GPU path in one run; see wbridge.testing.gpu_check.")
    ap.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu to run the parts on the host")
    ap.add_argument("--parts", nargs="*", choices=list(PARTS), help="only these parts (and the figures)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("gpu_check: SKIP: torch is not installed")
        return 0
    if args.device != "cpu":
        if not torch.cuda.is_available():
            print(
                "gpu_check: SKIP: no CUDA GPU here (torch.cuda.is_available() is False); tests run the parts on the CPU"
            )
            return 0
        torch.cuda.set_device(torch.device(args.device))
        name = torch.cuda.get_device_name(args.device)
    else:
        name = "host"
    print(f"gpu_check: {args.device} ({name}), torch {torch.__version__}", flush=True)
    return run(args.device, args.parts)[1]


if __name__ == "__main__":
    sys.exit(main())
