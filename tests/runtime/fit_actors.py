"""A publisher process for the framework-fit tests: fp32 master weights, published as the caller asks."""

from __future__ import annotations

from typing import Any

import torch

from wbridge import Publisher, Shard

TOKEN = "fit-token"
SHAPES = {"w": (64, 48), "b": (48,), "steps": (3,)}


def master(version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights at ``version`` (and an int64 counter that is never cast)."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {n: torch.randn(s, generator=g, dtype=torch.float32) for n, s in SHAPES.items() if n != "steps"}
    out["steps"] = torch.arange(3, dtype=torch.int64) + version
    return out


class Fp32Trainer:
    def __init__(self, url: str, *, dtype: Any = None, host_store: bool = True, **kwargs: Any) -> None:
        self.tensors = master(0)
        self.pub = Publisher("fit", url, host_store=host_store, token=TOKEN, **kwargs)
        self.pub.register({n: (t, Shard(n, tuple(t.shape))) for n, t in self.tensors.items()}, dtype=dtype)

    def publish(self, v: int, timeout: float = 30.0) -> int:
        for n, t in master(v).items():
            self.tensors[n].copy_(t)
        return self.pub.publish(timeout=timeout)

    def wait_for_subscribers(self, n: int, timeout: float) -> int:
        return self.pub.wait_for_subscribers(n, timeout=timeout)

    def close(self) -> None:
        self.pub.close()
