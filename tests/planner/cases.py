"""Layout cases for planner tests: trainer-side sources and rollout-side destinations.

Each case returns ``(sources, dests)``. Sizes are tiny so a test can execute every plan on real
byte buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from planner.compiler import LayoutBuilder
from planner.layout import Flat, Fused, RankLayout, Shard, Stack
from planner.layout import even_split as split


def shard(name: str, shape: tuple[int, ...], dim: int, part: tuple[int, int]) -> tuple[tuple[int, ...], Shard]:
    """Local shape and declaration of ``part`` (offset, size) of ``name`` along ``dim``."""
    o, s = part
    local = tuple(s if i == dim else n for i, n in enumerate(shape))
    offs = tuple(o if i == dim else 0 for i in range(len(shape)))
    return local, Shard(name, shape, offs)


def sharded(
    tensors: dict[str, tuple[tuple[int, ...], int | None]],
    tp: int,
    dp: int = 1,
    *,
    dtype: str = "float32",
    rank0: int = 0,
    pack: bool = True,
    uneven: bool = True,
) -> list[RankLayout]:
    """Ranks ``rank0 + d * tp + t``: every tensor split along its dim (None: replicated) into ``tp``."""
    out = []
    for d in range(dp):
        for t in range(tp):
            b = LayoutBuilder(rank0 + d * tp + t, pack=pack)
            for name, (shape, dim) in tensors.items():
                if dim is None:
                    b.add(name, shape, dtype, Shard(name, shape))
                else:
                    local, decl = shard(name, shape, dim, split(shape[dim], tp)[t])
                    b.add(name, local, dtype, decl)
            out.append(b.build())
    return out


def case_tp_row() -> tuple[list[RankLayout], list[RankLayout]]:
    t = {"w": ((12, 8), 0), "norm": ((8,), None)}
    return sharded(t, tp=2, dp=2), sharded(t, tp=3, rank0=100)


def case_tp_col() -> tuple[list[RankLayout], list[RankLayout]]:
    t = {"o_proj": ((6, 10), 1)}
    return sharded(t, tp=2, dtype="bfloat16"), sharded(t, tp=1, dtype="bfloat16", rank0=50)


def case_uneven_4_to_3() -> tuple[list[RankLayout], list[RankLayout]]:
    t = {"a": ((10, 7), 0), "b": ((5, 11), 1), "c": ((13,), 0)}
    return sharded(t, tp=4), sharded(t, tp=3, rank0=10)


def case_row_to_col() -> tuple[list[RankLayout], list[RankLayout]]:
    return sharded({"w": ((9, 7), 0)}, tp=3, dtype="float16"), sharded(
        {"w": ((9, 7), 1)}, tp=2, dtype="float16", rank0=3
    )


def case_replicas() -> tuple[list[RankLayout], list[RankLayout]]:
    t = {"w": ((16, 4), None), "b": ((4,), None), "scale": ((), None)}
    return sharded(t, tp=1, dp=3), sharded(t, tp=1, dp=2, rank0=10)


QKV = {"q": (8 * 4, 6), "k": (2 * 4, 6), "v": (2 * 4, 6)}  # 8 query heads, 2 kv heads, head_dim 4, hidden 6


def case_fused_qkv() -> tuple[list[RankLayout], list[RankLayout]]:
    """Trainer: separate q, k, v TP=2 row shards. Rollout: fused [q; k; v], each part TP=2 sliced."""
    src = sharded({n: (s, 0) for n, s in QKV.items()}, tp=2, dp=2)
    dst = []
    for t in range(2):
        parts = [Shard(n, s, (split(s[0], 2)[t][0], 0)) for n, s in QKV.items()]
        b = LayoutBuilder(20 + t)
        b.add("qkv_proj", (sum(s[0] for s in QKV.values()) // 2, 6), "float32", Fused(0, parts))
        dst.append(b.build())
    return src, dst


def megatron_fc1(tp: int, ffn: int, hidden: int, rank0: int = 0, dtype: str = "float32") -> list[RankLayout]:
    """Megatron linear_fc1 on TP rank t: ``[gate_t; up_t]`` (each part TP-sliced)."""
    out = []
    for t in range(tp):
        o, s = split(ffn, tp)[t]
        b = LayoutBuilder(rank0 + t)
        b.add(
            "linear_fc1",
            (2 * s, hidden),
            dtype,
            Fused(0, (Shard("gate", (ffn, hidden), (o, 0)), Shard("up", (ffn, hidden), (o, 0)))),
        )
        out.append(b.build())
    return out


def case_gate_up() -> tuple[list[RankLayout], list[RankLayout]]:
    return megatron_fc1(2, 12, 5), megatron_fc1(4, 12, 5, rank0=8)


def gqa_rollout(
    tp: int, heads: int, kv_heads: int, head_dim: int, hidden: int, rank0: int, dtype: str = "float32"
) -> list[RankLayout]:
    """vLLM QKVParallelLinear with ``kv_heads < tp``: each kv head replicated on ``tp / kv_heads`` ranks."""
    out = []
    qh = heads // tp
    rep = tp // kv_heads
    for t in range(tp):
        kvh = t // rep
        parts = (
            Shard("q", (heads * head_dim, hidden), (t * qh * head_dim, 0), (qh * head_dim, hidden)),
            Shard("k", (kv_heads * head_dim, hidden), (kvh * head_dim, 0), (head_dim, hidden)),
            Shard("v", (kv_heads * head_dim, hidden), (kvh * head_dim, 0), (head_dim, hidden)),
        )
        b = LayoutBuilder(rank0 + t)
        b.add("qkv_proj", ((qh + 2) * head_dim, hidden), dtype, Fused(0, parts))
        out.append(b.build())
    return out


def megatron_qkv(
    tp: int, heads: int, kv_heads: int, head_dim: int, hidden: int, rank0: int = 0, dtype: str = "float32"
) -> list[RankLayout]:
    """Megatron linear_qkv: per query group g, rows ``[q_g; k_g; v_g]``; TP splits whole groups."""
    out = []
    per = heads // kv_heads  # query heads per group
    gshape = (per * head_dim + 2 * head_dim, hidden)
    for t in range(tp):
        b = LayoutBuilder(rank0 + t)
        go, gs = split(kv_heads, tp)[t]
        stack = []
        for g in range(go, go + gs):
            stack.append(
                Fused(
                    0,
                    (
                        Shard("q", (heads * head_dim, hidden), (g * per * head_dim, 0)),
                        Shard("k", (kv_heads * head_dim, hidden), (g * head_dim, 0)),
                        Shard("v", (kv_heads * head_dim, hidden), (g * head_dim, 0)),
                    ),
                )
            )
        b.add("linear_qkv", (gs,) + gshape, dtype, Stack(tuple(stack)))
        out.append(b.build())
    return out


def case_gqa_kv_replicated() -> tuple[list[RankLayout], list[RankLayout]]:
    """Megatron interleaved QKV, TP=2 x DP=2 -> vLLM TP=4 with 2 kv heads (each on 2 ranks)."""
    src = megatron_qkv(2, 8, 2, 3, 5) + megatron_qkv(2, 8, 2, 3, 5, rank0=2)
    return src, gqa_rollout(4, 8, 2, 3, 5, rank0=30)


def vocab(
    tp: int, vocab_size: int, hidden: int, rank0: int, dtype: str = "float32", name: str = "embed"
) -> list[RankLayout]:
    """Vocab-parallel embedding with the vocabulary padded to a multiple of ``tp``."""
    per = -(-vocab_size // tp)
    out = []
    for t in range(tp):
        b = LayoutBuilder(rank0 + t)
        b.add(name, (per, hidden), dtype, Shard(name, (vocab_size, hidden), (t * per, 0), padded=True))
        out.append(b.build())
    return out


def case_padded_vocab() -> tuple[list[RankLayout], list[RankLayout]]:
    return vocab(4, 10, 3, 0), vocab(3, 10, 3, 40) + vocab(8, 10, 3, 50)


def experts_stacked(
    ep: int, experts: int, ffn: int, hidden: int, rank0: int = 0, dtype: str = "float32"
) -> list[RankLayout]:
    """vLLM-style FusedMoE: ``w13[e_local] = [gate_e; up_e]`` and ``w2[e_local] = down_e``."""
    out = []
    for r in range(ep):
        eo, es = split(experts, ep)[r]
        b = LayoutBuilder(rank0 + r)
        b.add(
            "w13",
            (es, 2 * ffn, hidden),
            dtype,
            Stack(
                tuple(
                    Fused(0, (Shard(f"e{e}.gate", (ffn, hidden)), Shard(f"e{e}.up", (ffn, hidden))))
                    for e in range(eo, eo + es)
                )
            ),
        )
        b.add(
            "w2", (es, hidden, ffn), dtype, Stack(tuple(Shard(f"e{e}.down", (hidden, ffn)) for e in range(eo, eo + es)))
        )
        out.append(b.build())
    return out


def experts_separate(
    ep: int, experts: int, ffn: int, hidden: int, rank0: int = 0, dp: int = 1, dtype: str = "float32"
) -> list[RankLayout]:
    """One tensor per expert and projection, EP placement (experts 0..E/ep-1 on EP rank 0...)."""
    out = []
    for d in range(dp):
        for r in range(ep):
            eo, es = split(experts, ep)[r]
            b = LayoutBuilder(rank0 + d * ep + r, pack=False)
            for e in range(eo, eo + es):
                for proj, shape in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
                    b.add(f"e{e}.{proj}", shape, dtype, Shard(f"e{e}.{proj}", shape))
            out.append(b.build())
    return out


def case_moe_separate_to_stacked() -> tuple[list[RankLayout], list[RankLayout]]:
    return experts_separate(4, 8, 3, 4, dp=2), experts_stacked(2, 8, 3, 4, rank0=20)


def case_moe_stacked_to_separate() -> tuple[list[RankLayout], list[RankLayout]]:
    return experts_stacked(3, 8, 3, 4), experts_separate(2, 8, 3, 4, rank0=20)


FLAT_TENSORS = {"a": (5, 3), "b": (7,), "c": (2, 2, 3), "d": (3, 4)}


def fsdp1_flat(
    world: int, tensors: dict[str, tuple[int, ...]], rank0: int = 0, dtype: str = "float32"
) -> list[RankLayout]:
    """FSDP1 flat parameter: all tensors concatenated, padded, cut into ``world`` equal 1-D shards."""
    sizes = {n: math.prod(s) for n, s in tensors.items()}
    total = sum(sizes.values())
    per = -(-total // world)
    out = []
    for r in range(world):
        lo, hi = r * per, (r + 1) * per
        segs, pos = [], 0
        for n, s in tensors.items():
            a, b = max(lo, pos), min(hi, pos + sizes[n])
            if a < b:
                segs.append((n, s, a - pos, b - pos))
            pos += sizes[n]
        b = LayoutBuilder(rank0 + r)
        b.add("flat_param", (per,), dtype, Flat(tuple(segs)))
        out.append(b.build())
    return out


def case_flat_fsdp1() -> tuple[list[RankLayout], list[RankLayout]]:
    src = fsdp1_flat(4, FLAT_TENSORS)
    dst = sharded({"a": ((5, 3), 0), "b": ((7,), 0), "c": ((2, 2, 3), 2), "d": ((3, 4), 1)}, tp=2, rank0=10)
    return src, dst


def case_flat_to_flat() -> tuple[list[RankLayout], list[RankLayout]]:
    return fsdp1_flat(3, FLAT_TENSORS), fsdp1_flat(5, FLAT_TENSORS, rank0=7)


def case_overlapping_sources() -> tuple[list[RankLayout], list[RankLayout]]:
    """Two DP replicas sharded differently (TP=2 and TP=3): source boxes overlap partially."""
    t = {"w": ((11, 4), 0)}
    return sharded(t, tp=2) + sharded(t, tp=3, rank0=2), sharded(t, tp=4, rank0=10)


CASES: dict[str, Callable[[], tuple[list[RankLayout], list[RankLayout]]]] = {
    name.removeprefix("case_"): fn for name, fn in globals().items() if name.startswith("case_")
}
