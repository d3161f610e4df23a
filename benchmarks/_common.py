"""Shared pieces of the end-to-end benchmarks: process driving, model sizes, the gather-and-broadcast
baselines, emulated compute, peak RSS and result files.

The baselines reproduce what RL frameworks do by default to move weights from a TP-sharded trainer
to TP-sharded rollout engines (all on torch.distributed gloo here, NCCL on GPUs):

* **A, gather + bucketed broadcast** (slime, verl): every TP shard is gathered to trainer rank 0
  into a full tensor; full tensors accumulate in a bucket of ``BUCKET_BYTES`` and when it is full
  each of its tensors is broadcast (async ops, then wait) in one process group holding trainer rank
  0 and every rollout rank; each rollout rank receives the full tensors and slices/fuses them into
  its own layout (``load_weights``). Bucket size: verl's ``update_weights_bucket_megabytes: 512``
  (verl/trainer/config/rollout/rollout.yaml) and slime's ``--update-weight-buffer-size`` default
  ``512 * 1024**2`` (slime/utils/arguments.py; slime broadcasts the bucket tensor by tensor in
  ``update_weight_from_distributed``).
* **B, per-tensor broadcast** (OpenRLHF's ``_broadcast_to_vllm``, one gathered parameter at a time,
  the shape of SGLang/vLLM ``update_weights_from_distributed``): gather one tensor, broadcast it to
  every rollout rank, which slices it locally; no bucket.

Trainer DP replicas other than the first take no part (the frameworks also send from one replica).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transports._util import free_port  # noqa: F401 (re-exported for callers)
from wbridge.testing.workers import Worker, call_all, gather  # noqa: F401 (used by the benchmarks)

BUCKET_BYTES = 512 * 1024**2
TOKEN = "wbridge-bench-token"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The actors' processes fork from one server that imported torch and wbridge once (a spawned
# process imports them itself: about 1.5 CPU-seconds each, most of a tiny run's own work).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "numpy", "wbridge", "wbridge.testing.synthetic"])


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def model_config(size: str):
    """A Qwen-like synthetic transformer (GQA 4:1, SwiGLU MLP, untied embeddings, RMSNorms).

    ``1g``, ``512m``, ``256m``: ``wbridge.testing.synthetic.ModelConfig.named`` (about 1.0 GiB in bf16:
    9 layers of hidden 2048, a 32k vocabulary; 4 layers and 16k; 2 layers and 8k); ``tiny`` is for
    smoke tests. Every split by TP=2 is even, so the gloo gathers of the baselines need no padding.
    """
    from wbridge.testing.synthetic import ModelConfig

    if size in ("1g", "512m", "256m"):
        return ModelConfig.named(size)
    if size == "tiny":
        return ModelConfig(hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=704, layers=2, vocab=2048)
    raise ValueError(f"unknown model size {size!r}; choose 1g, 512m, 256m or tiny")


MODEL_SIZES = ("1g", "512m", "256m", "tiny")


# ----------------------------------------------------------------------------------------------
# Driving objects in processes of their own
# ----------------------------------------------------------------------------------------------


Actor = Worker


def start_actors(specs: Iterable[tuple[str, Callable[..., Any], tuple, dict]], timeout: float = 180.0) -> list[Actor]:
    """Starts every actor (``CTX``), then waits for all constructors (they run in parallel)."""
    actors = [Actor(name, factory, *args, timeout=None, context=CTX, **kwargs) for name, factory, args, kwargs in specs]
    try:
        gather(actors, timeout)
    except BaseException:
        stop_all(actors)
        raise
    return actors


def stop_all(actors: Sequence[Actor]) -> None:
    for a in reversed(actors):
        a.stop()


# ----------------------------------------------------------------------------------------------
# Process-local helpers
# ----------------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fill_garbage(tensors: Mapping[str, tuple[Any, Any]], byte: int = 0xA5) -> None:
    """Overwrites every destination byte, so a path that skips a write fails the bit-exact check."""
    import torch

    for t, _ in tensors.values():
        t.view(-1).view(torch.uint8).fill_(byte)


class Compute:
    """Stand-in for GPU work: runs closures, then burns CPU until the step's duration is over.

    It runs on its own thread at a lower CPU priority (``nice``, 10 by default; Linux nice values
    are per thread), so the transfer threads of this and the other processes get the cores first:
    on a GPU node a step runs on the device and leaves the host CPUs to the weight transfer, while
    on this 2-core machine six emulated GPUs at equal priority would starve the transfer three
    times over. ``nice=0`` competes as an equal (the worst case). Not 19: at 19 the closures (the
    benchmark's own value writes and bit-exact checks) starve whenever other work shares the
    machine. The burn loop is numpy ufuncs, which release the GIL while they run.
    """

    def __init__(self, nice: int = 10) -> None:
        self.nice = nice
        self._work: list[tuple[Callable[[], Any] | None, float, float, threading.Event, list]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="compute", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import numpy as np

        if self.nice:
            try:
                os.setpriority(
                    os.PRIO_PROCESS,
                    threading.get_native_id(),
                    os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + self.nice,
                )
            except (OSError, AttributeError):
                pass
        a = np.random.default_rng(0).random(1 << 16)
        b = np.empty_like(a)
        while True:
            with self._cv:
                while not self._work and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                fn, start, deadline, done, out = self._work.pop(0)
            try:
                while time.perf_counter() < start:
                    np.sin(a, out=b)
                if fn is not None:
                    out.append(fn())
                while time.perf_counter() < deadline:
                    np.sin(a, out=b)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                out.append(e)
            done.set()

    def step(self, seconds: float, fn: Callable[[], Any] | None = None, at: float = 0.0) -> tuple[float, Any]:
        """Burns CPU for ``seconds`` in all, running ``fn`` once ``at`` x ``seconds`` have passed;
        returns (elapsed, fn's result). The step takes longer when ``fn`` does not fit."""
        t0 = time.perf_counter()
        done, out = threading.Event(), []
        with self._cv:
            self._work.append((fn, t0 + at * seconds, t0 + seconds, done, out))
            self._cv.notify()
        done.wait()
        if out and isinstance(out[0], BaseException):
            raise out[0]
        return time.perf_counter() - t0, (out[0] if out else None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()


# ----------------------------------------------------------------------------------------------
# Baselines: gather to trainer rank 0, broadcast full tensors, rollouts slice locally
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Groups:
    """The torch.distributed groups of the baselines (ranks 0..T-1 trainers, then the rollouts)."""

    world: Any
    tp: Any  # this trainer's TP group (None on rollouts)
    bcast: Any  # trainer rank 0 and every rollout rank (None on other trainers)
    trainers: int
    rollouts: int
    tp_size: int


def init_groups(rank: int, trainers: int, rollouts: int, tp_size: int, port: int, timeout: float = 120.0) -> Groups:
    """Joins one gloo process group spanning trainers and rollouts (what the frameworks build)."""
    from datetime import timedelta

    import torch.distributed as dist

    world = trainers + rollouts
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )
    tp_group = None
    for start in range(0, trainers, tp_size):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            tp_group = g
    bcast_ranks = [0] + list(range(trainers, world))
    g = dist.new_group(bcast_ranks)
    return Groups(dist.group.WORLD, tp_group, g if rank in bcast_ranks else None, trainers, rollouts, tp_size)


def leave_groups(groups: Groups | None) -> None:
    """Leaves the process group ``init_groups`` joined (an actor's close()); nothing where ``groups`` is None."""
    if groups is None:
        return
    import torch.distributed as dist

    dist.destroy_process_group()


def _shard_box(decl, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offs = tuple(decl.offsets) if decl.offsets is not None else (0,) * len(shape)
    sizes = tuple(decl.sizes) if decl.sizes is not None else tuple(shape)
    return offs, sizes


def trainer_boxes(cfg, tp: int) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """For each canonical tensor, the (offsets, sizes) box each trainer TP rank holds."""
    from wbridge.testing.synthetic import layout_decls

    out: dict[str, list] = {}
    for r in range(tp):
        for name, (shape, decl) in layout_decls(cfg, tp, r, fused=False).items():
            if decl.name != name:
                raise ValueError(f"trainer tensor {name!r} is not a plain shard of one canonical tensor")
            out.setdefault(name, []).append(_shard_box(decl, shape))
    return out


def load_targets(tensors: Mapping[str, tuple[Any, Any]]) -> dict[str, list[tuple[Any, tuple[slice, ...]]]]:
    """What ``load_weights`` does with a full tensor: for each canonical name, the local views to
    fill and the slice of the full tensor that goes into each (fused qkv/gate_up along dim 0)."""
    from planner.layout import Fused, Shard

    out: dict[str, list] = {}
    for name, (t, decl) in tensors.items():
        if isinstance(decl, Shard):
            offs, sizes = _shard_box(decl, t.shape)
            out.setdefault(decl.name, []).append((t, tuple(slice(o, o + s) for o, s in zip(offs, sizes))))
        elif isinstance(decl, Fused) and decl.dim == 0:
            row = 0
            for p in decl.parts:
                offs, sizes = _shard_box(p, t.shape)
                out.setdefault(p.name, []).append(
                    (t[row : row + sizes[0]], tuple(slice(o, o + s) for o, s in zip(offs, sizes)))
                )
                row += sizes[0]
        else:
            raise ValueError(f"rollout tensor {name!r}: the baseline loader handles Shard and Fused(dim=0) only")
    return out


def bucket_plan(specs, bucket_bytes: int) -> list[list[Any]]:
    """Tensors in model order, cut into buckets of at most ``bucket_bytes`` (one oversize tensor
    goes alone), as the frameworks' bucket iterators do; ``bucket_bytes=0`` gives one per tensor."""
    buckets: list[list[Any]] = []
    cur, size = [], 0
    for s in specs:
        if cur and (bucket_bytes <= 0 or size + s.nbytes > bucket_bytes):
            buckets.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def baseline_trainer_update(groups: Groups, rank: int, cfg, tensors, boxes, buckets) -> None:
    """A trainer rank's part of one baseline update (gather to rank 0, rank 0 broadcasts)."""
    import torch
    import torch.distributed as dist

    tp = groups.tp_size
    if rank >= tp:
        return  # another DP replica: the frameworks send from the first one only
    tp_rank = rank % tp
    for bucket in buckets:
        full_tensors = []
        for spec in bucket:
            local = tensors[spec.name][0]
            shard_boxes = boxes[spec.name]
            replicated = all(sz == tuple(spec.shape) for _, sz in shard_boxes)
            if replicated:
                full = local if tp_rank == 0 else None
            elif tp_rank == 0:
                recv = [torch.empty(sz, dtype=local.dtype) for _, sz in shard_boxes]
                dist.gather(local, recv, dst=0, group=groups.tp)
                full = torch.empty(spec.shape, dtype=local.dtype)
                for (offs, sz), part in zip(shard_boxes, recv):
                    full[tuple(slice(o, o + s) for o, s in zip(offs, sz))].copy_(part)
                del recv
            else:
                dist.gather(local, None, dst=0, group=groups.tp)
                full = None
            if full is not None:
                full_tensors.append(full)
        if tp_rank == 0:
            works = [dist.broadcast(t, src=0, group=groups.bcast, async_op=True) for t in full_tensors]
            for w in works:
                w.wait()
        del full_tensors


def baseline_rollout_update(groups: Groups, cfg, targets, buckets) -> None:
    """A rollout rank's part: receive every full tensor of each bucket, then slice it into place."""
    import torch
    import torch.distributed as dist

    dtype = _torch_dtype(cfg.dtype)
    for bucket in buckets:
        fulls = [torch.empty(s.shape, dtype=dtype) for s in bucket]
        works = [dist.broadcast(t, src=0, group=groups.bcast, async_op=True) for t in fulls]
        for w in works:
            w.wait()
        for spec, full in zip(bucket, fulls):
            for dst, src in targets.get(spec.name, ()):
                dst.copy_(full[src])
        del fulls


# ----------------------------------------------------------------------------------------------
# The transport yardstick: bare bulk reads, several readers at once
# ----------------------------------------------------------------------------------------------


def _numpy_multiarray(np):
    core = getattr(np, "_core", None) or np.core
    return core.multiarray


class BulkReader:
    """Reads ``size`` bytes split evenly over ``sources`` serving processes (one region each, read
    in parallel, one thread per source) with the bare transport API: no planning, no store, no
    versions. What the transport alone moves with the traffic pattern of a pull.

    Its memory is like the tensors a pull moves: numpy's transparent-huge-page advice is off here
    and in the serving processes (torch's CPU allocator does not give it; with THP in ``madvise``
    mode, as on this machine, huge pages make copies and ``process_vm_readv`` ~1.3x faster)."""

    def __init__(
        self,
        transport: str,
        size: int,
        sources: int = 1,
        op_size: int = 4 << 20,
        options: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        import transports
        from transports._serve import ServingProcess
        from transports.base import ReadBatch

        os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read by numpy in the serving processes
        _numpy_multiarray(np)._set_madvise_hugepage(False)
        cls = transports.get(transport)
        opts = dict(options or {})
        if cls.takes("streams"):
            opts.setdefault("streams", 4)
        self.size, self.timeout = size, timeout
        part = -(-size // sources)
        self.parts = [(i * part, min(part, size - i * part)) for i in range(sources)]
        self.servers = [
            ServingProcess(
                transport, [{"size": n, "seed": 1 + i}], token=TOKEN, options=opts, fill="pattern", timeout=timeout
            )
            for i, (_, n) in enumerate(self.parts)
        ]
        self.t = cls(token=TOKEN.encode(), **opts)
        self.dst = np.empty(size, dtype=np.uint8)
        self.dst.fill(0xA5)  # touch every page before timing
        self.local = self.t.register(self.dst.ctypes.data, size)
        self.peers, self.preps = [], []
        for server, (off, n) in zip(self.servers, self.parts):
            k = -(-n // op_size)
            src = np.arange(k, dtype=np.int64) * op_size
            batch = ReadBatch(np.zeros(k), src, np.zeros(k), src + off, np.minimum(op_size, n - src))
            peer = self.t.connect(server.endpoint, timeout=timeout)
            self.peers.append(peer)
            self.preps.append(self.t.prepare(peer, server.descriptors, [self.local], batch))
        self.pool = ThreadPoolExecutor(max(1, sources))
        self._read_all()  # warm up: connections, mappings

    def _read_all(self) -> None:
        for f in [self.pool.submit(self.t.read, p, timeout=self.timeout) for p in self.preps]:
            f.result()

    def measure(self, start_at: float, repeat: int) -> dict:
        """Waits until ``start_at`` (perf_counter, shared by processes on a host), reads ``repeat`` times."""
        from transports._serve import check_region

        while time.perf_counter() < start_at:
            time.sleep(0.0005)
        self.dst.fill(0xA5)
        t0 = time.perf_counter()
        for _ in range(repeat):
            self._read_all()
        t1 = time.perf_counter()
        ok = all(check_region(self.dst[off : off + n], 1 + i, "pattern") for i, (off, n) in enumerate(self.parts))
        return {"t0": t0, "t1": t1, "bytes": self.size * repeat, "verified": ok}

    def close(self) -> None:
        self.pool.shutdown()
        for prep, peer in zip(self.preps, self.peers):
            self.t.release(prep)
            self.t.disconnect(peer)
        self.t.deregister(self.local)
        self.t.close()
        for server in self.servers:
            server.stop()


def concurrent_bulk_gbps(
    transport: str,
    size: int,
    readers: int,
    sources: int = 1,
    repeat: int = 3,
    options: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
) -> dict:
    """Aggregate GB/s of ``readers`` processes each reading ``size`` bytes from ``sources`` serving
    processes of its own, ``repeat`` times, started together; and one reader's GB/s alone."""
    acts = start_actors(
        [
            (f"bulk-{transport}-{i}", BulkReader, (transport, size, sources), {"options": options})
            for i in range(readers)
        ],
        timeout=max(timeout, 300.0),
    )
    try:
        solo = acts[0].call("measure", time.perf_counter(), repeat, call_timeout=timeout)
        together = call_all(acts, "measure", time.perf_counter() + 0.2, repeat, call_timeout=timeout)
    finally:
        stop_all(acts)
    if not solo["verified"] or not all(r["verified"] for r in together):
        raise RuntimeError(f"bulk read over {transport}: bytes not verified")
    span = max(r["t1"] for r in together) - min(r["t0"] for r in together)
    return {
        "transport": transport,
        "size": size,
        "readers": readers,
        "sources": sources,
        "repeat": repeat,
        "options": dict(options or {}),
        "gbps": sum(r["bytes"] for r in together) / span / 1e9,
        "solo_gbps": solo["bytes"] / (solo["t1"] - solo["t0"]) / 1e9,
    }


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_at_start": load,
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def write_json(name: str, data: Mapping[str, Any], out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    return path


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def fmt_ratio(r: float) -> str:
    return "inf" if r == float("inf") else f"{r:.2f}"


def open_publisher(
    channel: str, url: str, rank: int, world: int, tensors: Mapping[str, Any], transport: str, **kw: Any
):
    """A benchmark trainer rank's registered publisher, serving one transport."""
    from wbridge import Publisher

    pub = Publisher(channel, url, rank=rank, world_size=world, token=TOKEN, transport=[transport], **kw)
    pub.register(tensors)
    return pub
