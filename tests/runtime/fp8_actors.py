"""A publisher process for the FP8 transform tests: fp32 weights published as fp8_block128."""

from __future__ import annotations

from typing import Any

import torch

from wbridge import Publisher, Shard

TOKEN = "fp8-token"
#: canonical name -> global shape: a shape with partial edge blocks, one of whole blocks, and a
#: TP-row-sharded one (partial column blocks), all published through the transform.
SHAPES = {"a.weight": (300, 200), "b.weight": (256, 384), "tp.weight": (256, 300)}


def master(version: int) -> dict[str, torch.Tensor]:
    """The fp32 weights at ``version``: per-row magnitudes spread over decades (so blocks get
    different scales, some values land in e4m3's subnormals) and one all-zero block."""
    g = torch.Generator().manual_seed(2000 + version)
    out = {}
    for n, shape in SHAPES.items():
        mag = torch.exp(torch.randn(shape[0], 1, generator=g) * 4)
        out[n] = torch.randn(shape, generator=g) * mag
    out["a.weight"][128:256, 0:128] = 0.0  # amax 0: scale_inv 1.0, the block stays 0
    out["bias"] = torch.randn(48, generator=g)  # not transformed: published as fp32 or register(dtype=)
    return out


class Fp8Trainer:
    """Rank ``rank`` of ``world_size`` (1 or 2): rank 0 holds a.weight, b.weight and bias whole;
    each rank holds its row half of tp.weight (128-aligned)."""

    def __init__(self, url: str, *, rank: int = 0, world_size: int = 1, dtype: Any = None, **kwargs: Any) -> None:
        self.rank, self.rows = rank, SHAPES["tp.weight"][0] // world_size
        self.tensors = self._mine(master(0))
        self.pub = Publisher("fp8", url, rank=rank, world_size=world_size, host_store=rank == 0, token=TOKEN, **kwargs)
        decls = {n: Shard(n, SHAPES.get(n, (48,))) for n in self.tensors}
        decls["tp.weight"] = Shard("tp.weight", SHAPES["tp.weight"], (self.rows * rank, 0))
        self.pub.register(
            {n: (t, decls[n]) for n, t in self.tensors.items()},
            dtype=dtype,  # for the tensors not transformed (bias)
            transforms={n: "fp8_block128" for n in self.tensors if n != "bias"},
        )

    def _mine(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = {"tp.weight": full["tp.weight"][self.rows * self.rank : self.rows * (self.rank + 1)].contiguous()}
        if self.rank == 0:
            mine.update({n: full[n] for n in ("a.weight", "b.weight", "bias")})
        return mine

    def publish(self, v: int, timeout: float = 30.0) -> int:
        for n, t in self._mine(master(v)).items():
            self.tensors[n].copy_(t)
        return self.pub.publish(timeout=timeout)

    def close(self) -> None:
        self.pub.close()
