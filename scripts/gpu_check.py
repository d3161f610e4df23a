"""GPU path check: CUDA tensors as publisher and subscriber memory through the nixl transport (VRAM).

Run by ``scripts/gpu_check.sh`` on a machine with one CUDA GPU, torch and nixl-cu12 (< 5 minutes):

1. a serving process puts a known pattern into a CUDA tensor (and a host tensor) and registers both
   with ``NixlTransport`` (``device="cuda:0"`` and ``"cpu"``);
2. this process reads them into garbage-filled CUDA (and host) destinations through one prepared
   batch of large and small reads: VRAM->VRAM, DRAM->VRAM, VRAM->DRAM; every byte is checked on the
   device, and repeated reads give the VRAM->VRAM bandwidth;
3. the ceilings on the same GPU: ``torch`` device-to-device copy (what ``publish()``'s staging copy
   of CUDA tensors is) and pinned host-to-device copy.

Exits 0 with ``gpu_check: SKIP: <why>`` where no CUDA GPU (or no nixl) exists; 1 on any wrong byte.
The last line is ``gpu_check: ok vram_read=<GB/s> d2d_copy=<GB/s> vram_vs_copy=<r> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PERIOD = 251
TIMEOUT = 60.0


def skip(why: str) -> int:
    print(f"gpu_check: SKIP: {why}")
    return 0


def pattern(n: int, device: str, shift: int = 0):
    import torch

    return ((torch.arange(n, device=device, dtype=torch.int64) + shift) % PERIOD).to(torch.uint8)


def serve(size: int) -> int:
    """``--serve``: registers a CUDA and a host region holding ``pattern``; one JSON line; waits on stdin."""
    import torch

    import transports

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    src_gpu = pattern(size, "cuda:0")
    src_cpu = pattern(size, "cpu", shift=7).pin_memory()
    torch.cuda.synchronize()
    with transports.get("nixl")() as t:
        rg = t.register(src_gpu.data_ptr(), size, device="cuda:0")
        rc = t.register(src_cpu.data_ptr(), size, device="cpu")
        out.write(
            json.dumps({"endpoint": t.endpoint().hex(), "gpu": rg.descriptor.hex(), "cpu": rc.descriptor.hex()}) + "\n"
        )
        sys.stdin.readline()
    return 0


def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / sorted(seconds)[len(seconds) // 2] / 1e9


def torch_ceilings(size: int, repeat: int) -> dict:
    import torch

    a = torch.empty(size, dtype=torch.uint8, device="cuda:0").fill_(1)
    b = torch.empty(size, dtype=torch.uint8, device="cuda:0").fill_(2)
    h = torch.empty(size, dtype=torch.uint8).fill_(3).pin_memory()
    out = {}
    for label, dst, src in (("d2d_copy", b, a), ("h2d_copy", b, h)):
        times = []
        for i in range(repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        out[label] = gbps(size, times)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=256 << 20, help="bytes per region (default 256 MiB)")
    ap.add_argument("--op-size", type=int, default=4 << 20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    try:
        import torch
    except ImportError:
        return skip("torch is not installed")
    if not torch.cuda.is_available():
        return skip("no CUDA GPU here (torch.cuda.is_available() is False); the CPU suite covers the rest")
    import numpy as np

    import transports
    from transports.base import ReadBatch

    if "nixl" not in transports.available():
        return skip("nixl-cu12 is not installed (pip install 'wbridge[nixl]')")
    size, op, rep = args.size, args.op_size, args.repeat
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {size} bytes per region")
    env = dict(os.environ, PYTHONPATH=ROOT)
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", str(size)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    failures = []
    figures: dict[str, float] = {}
    try:
        hello = json.loads(server.stdout.readline())
        remote = [bytes.fromhex(hello["gpu"]), bytes.fromhex(hello["cpu"])]
        dst_gpu = torch.full((size,), 0xC3, dtype=torch.uint8, device="cuda:0")
        dst_cpu = torch.full((size,), 0xC3, dtype=torch.uint8).pin_memory()
        want_gpu, want_cpu = pattern(size, "cuda:0"), pattern(size, "cpu", shift=7)
        with transports.get("nixl")() as t:
            lg = t.register(dst_gpu.data_ptr(), size, device="cuda:0")
            lc = t.register(dst_cpu.data_ptr(), size, device="cpu")
            peer = t.connect(bytes.fromhex(hello["endpoint"]), timeout=TIMEOUT)
            # VRAM->VRAM: whole region in op-size reads, reversed order, plus 1000 small reads on top
            n = size // op
            big = [(0, i * op, 0, (n - 1 - i) * op, op) for i in range(n)]
            rng = np.random.default_rng(0)
            small_src = rng.integers(0, size - 512, 1000)
            small = [(0, int(s), 0, i * 400 + 17, 300) for i, s in enumerate(small_src)]
            prep = t.prepare(peer, remote, [lg, lc], ReadBatch.of(big))
            times = []
            for i in range(rep + 1):
                t0 = time.perf_counter()
                t.read(prep, timeout=TIMEOUT)
                if i:
                    times.append(time.perf_counter() - t0)
            figures["vram_read"] = gbps(n * op, times)
            expect = torch.cat([want_gpu[i * op : (i + 1) * op] for i in reversed(range(n))])
            if not torch.equal(dst_gpu[: n * op], expect):
                failures.append("VRAM->VRAM bytes differ")
            dst_gpu.fill_(0xC3)
            prep_s = t.prepare(peer, remote, [lg, lc], ReadBatch.of(small))
            t.read(prep_s, timeout=TIMEOUT)
            for _, so, _, do, ln in small:
                if not torch.equal(dst_gpu[do : do + ln], want_gpu[so : so + ln]):
                    failures.append(f"small VRAM->VRAM read at {so} differs")
                    break
            # DRAM->VRAM and VRAM->DRAM in one batch (two memory-type pairs, two NIXL requests)
            dst_gpu.fill_(0xC3)
            dst_cpu.fill_(0xC3)
            mixed = t.prepare(peer, remote, [lg, lc], ReadBatch.of([(1, 0, 0, 0, size), (0, 0, 1, 0, size)]))
            t0 = time.perf_counter()
            t.read(mixed, timeout=TIMEOUT)
            figures["mixed_read"] = 2 * size / (time.perf_counter() - t0) / 1e9
            if not torch.equal(dst_gpu, want_cpu.to("cuda:0")):
                failures.append("DRAM->VRAM bytes differ")
            if not torch.equal(dst_cpu, want_gpu.cpu()):
                failures.append("VRAM->DRAM bytes differ")
            for p in (prep, prep_s, mixed):
                t.release(p)
            t.disconnect(peer)
        figures.update(torch_ceilings(size, rep))
    except Exception as e:  # noqa: BLE001 - reported as a failure with its cause
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        try:
            server.stdin.write("\n")
            server.stdin.close()
            status = server.wait(TIMEOUT)
        except (OSError, subprocess.TimeoutExpired):
            server.kill()
            status = server.wait()
        if status != 0:
            failures.append(f"serving process exited with {status}")
    print("gpu_check: nccl on CUDA needs two GPUs (NCCL refuses two ranks on one device): not run here")
    for f in failures:
        print(f"gpu_check: FAIL: {f}")
    if failures:
        return 1
    ratio = figures["vram_read"] / figures["d2d_copy"]
    print("gpu_check: ok " + " ".join(f"{k}={v:.2f}" for k, v in figures.items()) + f" vram_vs_copy={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
