"""Values and CPU references of ``wbridge.testing.gpu_check``'s parts: the publishers' tensors as pure
functions of (source, version), what each kind of subscriber must hold, and the byte comparison."""

from __future__ import annotations

import functools
import math
from typing import Any

#: canonical name -> shape of the fp32 masters: partial edge blocks both ways, whole blocks, a vector
FP32_SHAPES = {"a.weight": (300, 200), "b.weight": (256, 384), "bias": (48,)}


def _model_cfg():
    from wbridge.testing.synthetic import ModelConfig

    return ModelConfig.tiny()


def fp32_masters(version: int) -> dict[str, Any]:
    """fp32 weights at ``version``: row magnitudes over decades (blocks get different scales, some
    values land in e4m3's subnormals) and one all-zero block (scale 1.0, stays 0)."""
    import torch

    g = torch.Generator().manual_seed(3000 + version)
    out = {}
    for n, shape in FP32_SHAPES.items():
        mag = torch.exp(torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=g) * 4)
        out[n] = torch.randn(shape, generator=g) * mag
    out["a.weight"][128:256, 0:128] = 0.0
    return out


@functools.lru_cache(maxsize=2)
def _pattern(n: int) -> Any:
    """``n`` int16 words of a cheap pattern whose bf16 values are finite (exponent below 0x80)."""
    import torch

    return ((torch.arange(n, dtype=torch.int64) * 40503 >> 3) & 0x3FFF).to(torch.int16)


def sparse_bf16(version: int, nbytes: int) -> Any:
    """A bf16 vector of ``nbytes``: the pattern, then versions 1..``version`` each rewriting 1 in
    256 of its elements (so a delta carries ~0.4% of the words per version)."""
    import torch

    n = nbytes // 2
    bits = _pattern(n).clone()
    for v in range(1, version + 1):
        idx = torch.arange(n // 256, dtype=torch.int64) * 256 + (v * 7919) % 256
        bits[idx] = (((idx * 2654435761 + v * 97) >> 5) & 0x3FFF).to(torch.int16)
    return bits.view(torch.bfloat16)


def publisher_tensors(source: str, version: int, nbytes: int = 0) -> dict[str, tuple[Any, Any]]:
    """The publisher's tensors of ``source`` at ``version``, on the CPU, with their declarations."""
    from wbridge import Shard
    from wbridge.testing.synthetic import make_tensors

    if source == "model":  # a trainer rank: separate q/k/v and gate/up
        return make_tensors(_model_cfg(), 1, 0, fused=False, version=version)
    if source == "fp32":
        return {n: (t, Shard(n, tuple(t.shape))) for n, t in fp32_masters(version).items()}
    if source == "sparse":
        t = sparse_bf16(version, nbytes)
        return {"w": (t, Shard("w", tuple(t.shape)))}
    raise ValueError(f"unknown source {source!r}")


def fp8_reference(w: Any) -> tuple[Any, Any]:
    """The fp8_block128 format block by block on the CPU: per 128x128 block ``B`` (edge blocks
    partial) in float32, ``scale_inv = max|B| / 448`` (1.0 where 0), ``fp8 = B / scale_inv``."""
    import torch

    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / 128), math.ceil(cols / 128), dtype=torch.float32)
    for i in range(0, rows, 128):
        for j in range(0, cols, 128):
            block = w[i : i + 128, j : j + 128].to(torch.float32)
            scale_inv = block.abs().max() / 448.0
            if scale_inv == 0:
                scale_inv = torch.tensor(1.0)
            q[i : i + 128, j : j + 128] = (block / scale_inv).to(torch.float8_e4m3fn)
            s[i // 128, j // 128] = scale_inv
    return q, s


def subscriber_tensors(kind: str, version: int, nbytes: int = 0) -> dict[str, tuple[Any, Any]]:
    """What a subscriber of ``kind`` holds at ``version`` (the reference, on the CPU)."""
    import torch

    from wbridge import Shard
    from wbridge.testing.synthetic import make_tensors

    if kind == "model":  # a vLLM-like TP rank 0 of 2: fused qkv and gate_up
        return make_tensors(_model_cfg(), 2, 0, fused=True, version=version)
    masters = fp32_masters(version) if kind in ("bf16", "fp8") else None
    if kind == "bf16":
        return {n: (t.to(torch.bfloat16), Shard(n, tuple(t.shape))) for n, t in masters.items()}
    if kind == "fp8":
        out = {"bias": (masters["bias"], Shard("bias", FP32_SHAPES["bias"]))}
        for n in ("a.weight", "b.weight"):
            q, s = fp8_reference(masters[n])
            out[n] = (q, Shard(n, tuple(q.shape)))
            out[n + "_scale_inv"] = (s, Shard(n + "_scale_inv", tuple(s.shape)))
        return out
    if kind == "sparse":
        return publisher_tensors("sparse", version, nbytes)
    raise ValueError(f"unknown subscriber kind {kind!r}")


def garbage_like(tensors: dict[str, tuple[Any, Any]], device: str) -> dict[str, tuple[Any, Any]]:
    """Same shapes, dtypes and declarations on ``device``, every byte 0x5A."""
    import torch

    out = {}
    for n, (t, decl) in tensors.items():
        raw = torch.full((t.numel() * t.element_size(),), 0x5A, dtype=torch.uint8, device=device)
        out[n] = (raw.view(t.dtype).view(t.shape), decl)
    return out


def differing(held: dict[str, tuple[Any, Any]], want: dict[str, tuple[Any, Any]]) -> list[str]:
    """Names of held tensors whose bytes (copied to the CPU) differ from the reference's."""
    import torch

    def raw(t: Any) -> Any:
        return t.detach().cpu().contiguous().view(-1).view(torch.uint8)

    return [n for n, (t, _) in held.items() if not torch.equal(raw(t), raw(want[n][0]))]
