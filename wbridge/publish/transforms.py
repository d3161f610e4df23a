"""Named transforms a publisher applies at snapshot time (``Publisher.register(transforms=...)``).

``"fp8_block128"``: block-wise float8_e4m3fn with one float32 inverse scale per 128x128 block,
the DeepSeek-V3 / Kimi-K2 checkpoint format. A 2-D floating weight ``W`` declared as canonical
``name`` is published as two canonical tensors:

- ``name``: ``W`` in ``float8_e4m3fn``, same shape;
- ``name + "_scale_inv"`` (``x.weight`` -> ``x.weight_scale_inv``): float32, shape
  ``[ceil(rows/128), ceil(cols/128)]``.

Per block ``B`` (edge blocks are the partial rows/columns left over, not padded), computed in
float32: ``scale_inv = amax(|B|) / 448`` (448: the largest e4m3fn value), or ``1.0`` where that is
0 (an all-zero block stays 0), and ``fp8 = (B / scale_inv)`` cast to ``float8_e4m3fn`` (torch's
round-to-nearest-even). Dequantised: ``fp8 * scale_inv`` per block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.layout import Declaration, Shard

from ..errors import UsageError

FP8_BLOCK128 = "fp8_block128"
#: The transforms ``Publisher.register(transforms=)`` knows.
TRANSFORMS = (FP8_BLOCK128,)
BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"


def check(transforms: Mapping[str, str] | None, tensors: Mapping[str, Any], who: str, zero_copy: bool) -> dict:
    """``transforms`` as a plain dict, every key a registered tensor and every value a known transform."""
    if not transforms:
        return {}
    if not isinstance(transforms, Mapping):
        raise UsageError(f"{who}: transforms must map local tensor names to transform names")
    if zero_copy:
        raise UsageError(
            f"{who}: register(transforms=) transforms {sorted(transforms)} at snapshot time, but staging=ZeroCopy() "
            "serves the live tensors as they are; use staging=Staging() to transform"
        )
    for name, kind in transforms.items():
        if name not in tensors:
            raise UsageError(f"{who}: transform {kind!r} names tensor {name!r}, which is not registered")
        if kind not in TRANSFORMS:
            raise UsageError(f"{who}: tensor {name!r}: unknown transform {kind!r}; known: {TRANSFORMS}")
    return dict(transforms)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def fp8_block128_layout(name: str, shape: tuple[int, ...], decl: Declaration, who: str) -> list[tuple]:
    """The two local tensors ``(local name, shape, dtype, declaration)`` that ``fp8_block128`` lays
    a local weight out as; a ``UsageError`` naming it unless the weight is a 2-D ``Shard`` covering
    whole 128x128 blocks of the canonical tensor (an edge may end where the canonical tensor does)."""
    if not isinstance(decl, Shard) or len(shape) != 2 or len(decl.global_shape) != 2 or decl.padded:
        raise UsageError(f"{who}: tensor {name!r}: fp8_block128 takes a 2-D tensor declared as an unpadded 2-D Shard")
    if decl.sizes is not None and tuple(decl.sizes) != tuple(shape):
        raise UsageError(f"{who}: tensor {name!r}: fp8_block128 takes a Shard whose box is the local tensor")
    offsets = decl.offsets or (0, 0)
    for dim, (o, n, g) in enumerate(zip(offsets, shape, decl.global_shape)):
        if o % BLOCK or ((o + n) % BLOCK and o + n != g):
            raise UsageError(
                f"{who}: tensor {name!r} ({decl.name}): fp8_block128 needs whole {BLOCK}x{BLOCK} blocks, but "
                f"dim {dim} covers [{o}, {o + n}) of {g}; shard on multiples of {BLOCK}"
            )
    scale = Shard(
        decl.name + SCALE_SUFFIX,
        tuple(blocks(g) for g in decl.global_shape),
        tuple(o // BLOCK for o in offsets),
    )
    return [
        (name, shape, "float8_e4m3fn", decl),
        (name + SCALE_SUFFIX, tuple(blocks(n) for n in shape), "float32", scale),
    ]


def _spans(n: int, step: int = 0) -> list[tuple[int, int, int, int]]:
    """``(start, stop, blocks, block size)``: the whole blocks of ``n`` (``step`` elements at most
    per span, a multiple of ``BLOCK``; 0: one span), then its partial edge block."""
    full = n // BLOCK * BLOCK
    step = step or full
    spans = [(a, min(a + step, full), (min(a + step, full) - a) // BLOCK, BLOCK) for a in range(0, full, step)]
    if n > full:
        spans.append((full, n, 1, n - full))
    return spans


#: Bytes of float32 temporaries one step of the quantising copy works on: on the host a strip that
#: stays in cache (and out of fresh ``mmap`` pages); on a GPU the whole tensor up to 256 MiB.
STRIP_BYTES = {"cpu": 1 << 20, "cuda": 1 << 28}


class Fp8Block128:
    """The snapshot target of one ``fp8_block128`` weight: ``copy_(src)`` quantises ``src`` into the
    staged fp8 weight and scales, vectorised over whole strips of block rows (a few ops per strip;
    edge blocks are their own strips, no padding).

    - ``weight``: the staged ``float8_e4m3fn`` view, the live tensor's shape.
    - ``scale_inv``: the staged float32 view, ``[ceil(rows/128), ceil(cols/128)]``.
    """

    def __init__(self, weight: Any, scale_inv: Any) -> None:
        self.weight, self.scale_inv = weight, scale_inv
        rows, cols = weight.shape
        budget = STRIP_BYTES["cpu" if weight.device.type == "cpu" else "cuda"]
        self.row_spans = _spans(rows, max(1, budget // max(1, 4 * cols * BLOCK)) * BLOCK)
        self.col_spans = _spans(cols)

    def copy_(self, src: Any, non_blocking: bool = False) -> None:
        import torch

        # a tensor on the device, not a Python scalar: CUDA divides by a CPU scalar as a multiply by
        # its float32 reciprocal, which rounds half of all scales differently from true division
        e4m3_max = torch.tensor(E4M3_MAX, dtype=torch.float32, device=src.device)
        for r0, r1, nr, br in self.row_spans:
            for c0, c1, nc, bc in self.col_spans:
                x = src[r0:r1, c0:c1].view(nr, br, nc, bc).float()
                # amax|x| without a |x| temporary: max(amax(x), -amin(x)) is the same value
                s = torch.maximum(x.amax(dim=(1, 3)), x.amin(dim=(1, 3)).neg_()).div_(e4m3_max)
                s = s.masked_fill_(s == 0, 1.0)
                self.scale_inv[r0 // BLOCK : r0 // BLOCK + nr, c0 // BLOCK : c0 // BLOCK + nc].copy_(s)
                self.weight[r0:r1, c0:c1].view(nr, br, nc, bc).copy_(x / s[:, None, :, None])
