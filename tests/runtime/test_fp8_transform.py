"""FP8 as a named transform (``register(transforms={name: "fp8_block128"})``): fp32 trainer
weights published as block-wise e4m3 plus per-128x128-block inverse scales (the DeepSeek-V3 /
Kimi-K2 checkpoint format), checked bit for bit against a reference quantiser written here from
the format's definition, across processes, TP shards and versions."""

from __future__ import annotations

import math

import pytest
import torch

from wbridge import Publisher, Shard, Subscriber, UsageError, ZeroCopy
from wbridge.testing.gpu_check_data import fp8_reference

from .fp8_actors import SHAPES, TOKEN, Fp8Trainer, master
from .harness import Worker, free_port

FP8 = torch.float8_e4m3fn


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format, block by block (``wbridge.testing.gpu_check_data.fp8_reference``, the CPU reference
    the GPU check compares the device kernels with); and the format is what it claims: each block
    dequantised is within e4m3's precision of the block."""
    q, s = fp8_reference(w)
    rows, cols = w.shape
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block = w[i : i + 128, j : j + 128].to(torch.float32)
            scale_inv = s[i // 128, j // 128]
            err = (q[i : i + 128, j : j + 128].to(torch.float32) * scale_inv - block).abs()
            assert bool((err <= block.abs() / 16 + scale_inv * 2.0**-9).all())
    return q, s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block128_two_tp_ranks_bitwise_against_reference(dtype) -> None:
    """``dtype``: what ``register(dtype=)`` publishes the untransformed bias in, next to the fp8 weights."""
    url = f"tcp://127.0.0.1:{free_port()}"
    ranks = [Worker(f"trainer{r}", Fp8Trainer, url, rank=r, world_size=2, dtype=dtype, transport="tcp") for r in (0, 1)]
    try:
        sub = Subscriber("fp8", url, token=TOKEN, transport="tcp")
        held: dict[str, torch.Tensor] = {"bias": torch.full((48,), float("nan"), dtype=dtype)}
        decls = {"bias": Shard("bias", (48,))}
        for n, (r, c) in SHAPES.items():
            held[n] = torch.full((r, c), float("nan"), dtype=FP8)
            held[n + "_scale_inv"] = torch.full((math.ceil(r / 128), math.ceil(c / 128)), float("nan"))
            decls[n] = Shard(n, (r, c))
            decls[n + "_scale_inv"] = Shard(n + "_scale_inv", tuple(held[n + "_scale_inv"].shape))
        with sub:
            sub.register({n: (t, decls[n]) for n, t in held.items()})
            for v in (1, 2):
                for w in ranks:
                    w.send("publish", v)
                assert [w.result(30) for w in ranks] == [v, v]
                assert sub.pull(min_version=v, timeout=30) == v
                want = master(v)
                assert torch.equal(_bits(held["bias"]), _bits(want["bias"].to(dtype)))
                for n in SHAPES:
                    q, s = reference(want[n])
                    assert torch.equal(_bits(held[n]), _bits(q)), (v, n)
                    assert torch.equal(_bits(held[n + "_scale_inv"]), _bits(s)), (v, n)
                assert bool((held["a.weight_scale_inv"][1, 0] == 1.0).all()), "an all-zero block has scale 1.0"
    finally:
        for w in ranks:
            w.stop()


@pytest.mark.timeout(60)
def test_fp8_block128_usage_errors() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    fp8 = {"w": "fp8_block128"}
    with Publisher("fp8", url, host_store=True, token=TOKEN, transport="tcp") as pub:
        for local, offsets in (((64, 200), (64, 0)), ((100, 200), (0, 0)), ((128, 100), (0, 64))):
            with pytest.raises(UsageError, match=r"'w' \(layer.weight\).*whole 128x128 blocks"):
                pub.register({"w": (torch.zeros(local), Shard("layer.weight", (256, 200), offsets))}, transforms=fp8)
        with pytest.raises(UsageError, match="'w'.*2-D"):
            pub.register({"w": (torch.zeros(256), Shard("w", (256,)))}, transforms=fp8)
        with pytest.raises(UsageError, match="'w'.*floating"):
            pub.register({"w": (torch.zeros(4, 4, dtype=torch.int32), Shard("w", (4, 4)))}, transforms=fp8)
        with pytest.raises(UsageError, match="unknown transform"):
            pub.register({"w": (torch.zeros(4, 4), Shard("w", (4, 4)))}, transforms={"w": "fp4"})
        with pytest.raises(UsageError, match="'v', which is not registered"):
            pub.register({"w": (torch.zeros(4, 4), Shard("w", (4, 4)))}, transforms={"v": "fp8_block128"})
    with Publisher("fp8", url, host_store=True, token=TOKEN, staging=ZeroCopy(), transport="tcp") as pub:
        with pytest.raises(UsageError, match=r"staging=ZeroCopy\(\)"):
            pub.register({"w": (torch.zeros(256, 256), Shard("w", (256, 256)))}, transforms=fp8)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_fp8_block128_strips_match_reference(src_dtype) -> None:
    """The snapshot's quantising copy on its own, on a weight wide enough that it works in several
    strips of block rows (plus edge blocks both ways), from fp32 and bf16 masters."""
    from wbridge.publish.transforms import Fp8Block128

    g = torch.Generator().manual_seed(7)
    w = (torch.randn(1100, 2100, generator=g) * torch.exp(torch.randn(1100, 1, generator=g) * 4)).to(src_dtype)
    q, s = torch.empty(1100, 2100, dtype=FP8), torch.empty(9, 17)
    target = Fp8Block128(q, s)
    assert len(target.row_spans) > 2
    target.copy_(w)
    want_q, want_s = reference(w)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(_bits(s), _bits(want_s))
