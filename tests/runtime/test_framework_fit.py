"""What RL frameworks need from the API: fp32 trainers publishing bf16, version notifications
without a pull, waiting for subscribers, and a clear error instead of a sync-mode deadlock."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from wbridge import Publisher, Shard, Subscriber, UsageError, WaitTimeout, ZeroCopy

from .fit_actors import SHAPES, TOKEN, Fp32Trainer, master
from .harness import Worker, WorkerError, free_port


def _rollout(url: str, dtype: torch.dtype = torch.bfloat16, **kwargs) -> tuple[Subscriber, dict]:
    sub = Subscriber("fit", url, token=TOKEN, transport="tcp", **kwargs)
    tensors = {
        n: torch.full(s, 7, dtype=torch.int64) if n == "steps" else torch.full(s, float("nan"), dtype=dtype)
        for n, s in SHAPES.items()
    }
    sub.register({n: (t, Shard(n, tuple(t.shape))) for n, t in tensors.items()})
    return sub, tensors


def _expect(v: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t if n == "steps" else t.to(dtype) for n, t in master(v).items()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_trainer_publishes_low_precision_bit_exact(dtype) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=dtype, transport="tcp")
    try:
        sub, tensors = _rollout(url, dtype)
        with sub:
            for v in (1, 2):
                assert pub.call("publish", v) == v
                assert sub.pull(min_version=v, timeout=30) == v
                for n, want in _expect(v, dtype).items():
                    got = tensors[n]
                    assert got.dtype == want.dtype and torch.equal(
                        got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)
                    ), n
    finally:
        pub.stop()


@pytest.mark.timeout(90)
def test_cast_to_a_column_sliced_reader_stays_bit_exact() -> None:
    """A reader whose layout differs from the trainer's (columns of ``w``), over several versions:
    publishers pack their slots for such readers, and a cast must not be packed as raw bytes."""
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp")
    try:
        sub = Subscriber("fit", url, token=TOKEN, transport="tcp")
        cols = torch.full((64, 24), float("nan"), dtype=torch.bfloat16)
        with sub:
            sub.register({"w": (cols, Shard("w", (64, 48), (0, 24)))})
            for v in (1, 2, 3):
                assert pub.call("publish", v) == v
                assert sub.pull(min_version=v, timeout=30) == v
                want = master(v)["w"].to(torch.bfloat16)[:, 24:]
                assert torch.equal(cols.view(torch.int16), want.contiguous().view(torch.int16)), v
    finally:
        pub.stop()


@pytest.mark.timeout(60)
def test_cast_with_zero_copy_is_a_usage_error() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    with Publisher("fit", url, host_store=True, token=TOKEN, staging=ZeroCopy(), transport="tcp") as pub:
        t = torch.zeros(4, 4)
        with pytest.raises(UsageError, match=r"staging=ZeroCopy\(\)"):
            pub.register({"w": (t, Shard("w", (4, 4)))}, dtype=torch.bfloat16)
        with pytest.raises(UsageError, match="dtype must be one of"):
            pub.register({"w": (t, Shard("w", (4, 4)))}, dtype=torch.int8)


@pytest.mark.timeout(90)
def test_wait_for_subscribers_and_version_notifications() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp")
    try:
        with pytest.raises(WorkerError, match="0 of 1 subscribers") as e:
            pub.call("wait_for_subscribers", 1, 0.3)
        assert e.value.exc_type == "WaitTimeout"
        watcher = Subscriber("fit", url, token=TOKEN)  # never registers
        sub, tensors = _rollout(url)
        with watcher, sub:
            assert pub.call("wait_for_subscribers", 1, 10.0) == 1
            with pytest.raises(WaitTimeout):
                watcher.wait_version(after=0, timeout=0.2)
            pub.call("publish", 1)
            assert watcher.wait_version(after=0, timeout=10) == 1
            assert sub.wait_version(timeout=10) == 1  # newer than what it holds (nothing yet)
            assert torch.isnan(tensors["w"]).all(), "wait_version must not pull"
            sub.close()  # one_step_off publishers would wait for its acks; the watcher is never waited for

            async def two_versions() -> list[int]:
                seen = []
                async for v in watcher.versions():
                    seen.append(v)
                    if len(seen) == 2:
                        return seen
                return seen

            async def drive() -> list[int]:
                task = asyncio.create_task(two_versions())
                await asyncio.sleep(0.3)
                for v in (2, 3):
                    await asyncio.to_thread(pub.call, "publish", v)
                    await asyncio.sleep(0.3)
                return await asyncio.wait_for(task, 20)

            assert asyncio.run(drive()) == [2, 3]
    finally:
        pub.stop()


@pytest.mark.timeout(90)
def test_sync_mode_pull_ahead_is_an_immediate_clear_error() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    pub = Worker("trainer", Fp32Trainer, url, dtype=torch.bfloat16, transport="tcp", mode="sync")
    try:
        sub, tensors = _rollout(url)
        with sub:
            pub.send("publish", 1)  # blocks until this subscriber acks 1
            sub.wait_version(after=0, timeout=20)
            t0 = time.monotonic()
            with pytest.raises(UsageError, match="sync mode"):
                sub.pull(min_version=2, timeout=20)
            assert time.monotonic() - t0 < 5, "the misuse must be reported at once, not after the timeout"
            assert sub.pull(timeout=20) == 1
            assert pub.result(20) == 1
    finally:
        pub.stop()
