"""Publisher and subscriber processes for the runtime tests (driven through ``harness.Worker``)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from wbridge import Publisher, Subscriber
from wbridge.testing.synthetic import ModelConfig, layout_decls, make_tensors, mismatches, set_version

TOKEN = "test-token"


def model(kind: str = "small") -> ModelConfig:
    if kind == "tiny":
        return ModelConfig.tiny()
    # ~6 MiB: big enough that reads split across replicas are measurable, small enough to be fast
    return ModelConfig(hidden=256, heads=8, kv_heads=2, head_dim=32, intermediate=704, layers=3, vocab=2003)


class PubActor:
    def __init__(
        self,
        url: str,
        rank: int,
        world: int,
        tp: int,
        *,
        host_store: bool = False,
        model_kind: str = "small",
        token: str = TOKEN,
        **kwargs: Any,
    ) -> None:
        self.cfg = model(model_kind)
        self.tensors = make_tensors(self.cfg, tp, rank % tp, fused=False, version=None)
        self.pub = Publisher("t", url, rank=rank, world_size=world, host_store=host_store, token=token, **kwargs)
        self.pub.register(self.tensors)

    def publish(self, v: int, timeout: float = 30.0) -> dict:
        set_version(self.tensors, v)
        got = self.pub.publish(timeout=timeout)
        return {"v": got, "t_ret": time.time(), "stall_s": self.pub.stats.last.stall_s}

    def wait_acked(self, v: int, timeout: float = 30.0) -> float:
        self.pub.wait_acked(v, timeout=timeout)
        return time.time()

    def live_subscribers(self) -> int:
        return self.pub.live_subscribers()

    def wait_reader(self, v: int, timeout: float = 30.0) -> None:
        """Blocks until some live subscriber is reading version ``v``."""
        deadline = time.monotonic() + timeout
        while not any(s["reading"] == v for s in self.pub.subscribers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no subscriber started reading version {v}")
            time.sleep(0.01)

    def close(self) -> None:
        self.pub.close()


class SubActor:
    def __init__(
        self,
        url: str,
        tp: int,
        rank: int,
        *,
        fused: bool = True,
        model_kind: str = "small",
        token: str = TOKEN,
        extra: dict | None = None,
        fault: tuple[str, dict] | None = None,
        **kwargs: Any,
    ) -> None:
        self.cfg = model(model_kind)
        self.tensors = make_tensors(self.cfg, tp, rank, fused=fused, version=None, fill_value=0x5A)
        if extra:
            import torch

            from wbridge import Shard

            for name, (shape, gshape) in extra.items():
                self.tensors[name] = (torch.zeros(shape, dtype=torch.bfloat16), Shard(name, tuple(gshape)))
        self.sub = Subscriber("t", url, token=token, **kwargs)
        if fault is not None:
            from wbridge.testing.faults import inject, wrapper

            inject(self.sub, wrapper(fault[0], **fault[1]))
        self.sub.register(self.tensors)

    def fill(self, byte: int) -> None:
        for t, _ in self.tensors.values():
            t.view(-1).view(__import__("torch").uint8).fill_(byte)

    def untouched(self, byte: int) -> bool:
        """Whether every byte of every tensor still holds ``byte`` (the garbage fill)."""
        import torch

        return all(bool((t.view(-1).view(torch.uint8) == byte).all()) for t, _ in self.tensors.values())

    def digest(self) -> str:
        h = hashlib.sha256()
        for t, _ in self.tensors.values():
            h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return h.hexdigest()

    def pull(
        self,
        min_version: int | None = None,
        timeout: float = 30.0,
        garbage: int | None = 0xA5,
        delay: float = 0.0,
        gate: str | None = None,
    ) -> dict:
        """Pulls after ``delay`` seconds, or with ``gate`` (a file's path) once the file exists or
        ``delay`` has passed, whichever comes first; ``t_start`` is when the pull began."""
        if garbage is not None:
            self.fill(garbage)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not (gate is not None and os.path.exists(gate)):
            time.sleep(0.01)
        t0 = time.time()
        v = self.sub.pull(min_version=min_version, timeout=timeout)
        t1 = time.time()
        return {
            "v": v,
            "untouched": garbage is not None and self.untouched(garbage),  # nothing was written
            "t_start": t0,
            "t_ack": t1,
            "bad": mismatches(self.tensors, v),
            "bytes_per_source": dict(self.sub.stats.bytes_per_source),
            "transports": dict(self.sub.stats.transports),
            "retries": self.sub.stats.last.retries if self.sub.stats.last else 0,
            "ops": self.sub.stats.last.ops if self.sub.stats.last else 0,
            "nbytes": self.sub.stats.last.nbytes if self.sub.stats.last else 0,
            "from_publishers": self.sub.stats.last.nbytes_from_publishers if self.sub.stats.last else 0,
            "from_peers": self.sub.stats.last.nbytes_from_peers if self.sub.stats.last else 0,
        }

    def try_pull(self, timeout: float = 10.0) -> dict:
        """A pull expected to fail: the error class and the state it left."""
        t0 = time.time()
        try:
            v = self.sub.pull(timeout=timeout)
            return {"error": None, "v": v, "elapsed": time.time() - t0}
        except Exception as e:  # noqa: BLE001
            return {
                "error": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
                "elapsed": time.time() - t0,
                "version": self.sub.version,
            }

    def check(self, v: int) -> list[str]:
        return mismatches(self.tensors, v)

    def version(self) -> int | None:
        return self.sub.version

    def close(self) -> None:
        self.sub.close()


def full_layout_names(kind: str = "small") -> list[str]:
    return list(layout_decls(model(kind), 1, 0, fused=False))
