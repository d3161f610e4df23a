"""The runtime tests' byte check (``wbridge.testing.synthetic.mismatches``) against an independent
reference: each subscriber's expected bytes come from plain slices of the canonical tensors
(``expected_bits``), not from the planner's mapping (``planner.compiler.pieces_for``) that the
transfer itself uses, so a mapping bug cannot move the bytes wrongly and expect them there too."""

from __future__ import annotations

import numpy as np
import pytest

from planner import compiler
from planner.layout import Fused, Shard, Stack
from wbridge.testing.synthetic import (
    ModelConfig,
    canonical_bits,
    expected_bits,
    layout_decls,
    make_tensors,
    mismatches,
)

CASES = [(tp, rank, fused) for tp in (1, 2, 3, 4) for rank in range(tp) for fused in (False, True)]


@pytest.mark.parametrize("tp,rank,fused", CASES)
def test_slices_agree_with_the_planners_mapping_on_the_synthetic_layouts(tp, rank, fused) -> None:
    """Two derivations of every synthetic layout (GQA with replicated kv heads at tp 3 and 4, an
    odd vocabulary) that share no code give the same bytes."""
    tensors = make_tensors(ModelConfig.tiny(), tp, rank, fused=fused, version=3)
    assert tensors and mismatches(tensors, 3) == []
    assert sorted(mismatches(tensors, 4)) == sorted(tensors)  # every tensor differs between versions


def test_qkv_slices_by_hand() -> None:
    """A fused qkv rank, cut by hand: rows of q, then k, then v, each from its canonical tensor."""
    cfg = ModelConfig.tiny()
    shape, decl = layout_decls(cfg, 2, 1, fused=True)["model.layers.0.self_attn.qkv_proj.weight"]
    q, k, v = (canonical_bits(p.name, p.global_shape, (0, 0), p.global_shape, 2, 7) for p in decl.parts)
    h, d = cfg.hidden, cfg.head_dim
    by_hand = np.concatenate([q[h // 2 :], k[d:], v[d:]])  # rank 1 of 2: the second half of q, kv head 1
    got = expected_bits("qkv", shape, decl, 2, 7, np.zeros(int(np.prod(shape)), np.uint16))
    assert got.shape == shape and np.array_equal(got, by_hand)


def test_padded_and_stacked_boxes() -> None:
    g = (5, 4)
    canon = canonical_bits("w", g, (0, 0), g, 4, 1)
    base = np.full(8 * 4, 7, np.uint32)
    padded = expected_bits("w", (8, 4), Shard("w", g, (3, 0), padded=True), 4, 1, base)
    assert np.array_equal(padded[:2], canon[3:]) and (padded[2:] == 7).all()  # past the vocabulary: untouched
    w13 = Fused(0, (Shard("w", g, (0, 0), (2, 4)), Shard("w", g, (4, 0), (1, 4))))
    stack = Stack((Shard("a", g, (1, 0), (3, 4)), w13))
    got = expected_bits("s", (2, 3, 4), stack, 4, 1, np.zeros(24, np.uint32))
    assert np.array_equal(got[0], canonical_bits("a", g, (0, 0), g, 4, 1)[1:4])
    assert np.array_equal(got[1], np.concatenate([canon[:2], canon[4:]]))


def test_a_symmetric_mapping_bug_is_caught(monkeypatch) -> None:
    """Fused parts laid out in reverse by the planner's mapping: the bytes written through it and
    an expectation computed through it would agree; the slices do not."""
    real = compiler._fused_pieces

    def reversed_parts(name, decl, shape):
        return real(name, Fused(decl.dim, tuple(reversed(decl.parts))), shape)

    monkeypatch.setattr(compiler, "_fused_pieces", reversed_parts)
    tensors = make_tensors(ModelConfig.tiny(), 2, 0, fused=True, version=2)  # filled through the bug
    fused = [n for n, (_, d) in tensors.items() if isinstance(d, Fused)]
    assert fused and sorted(mismatches(tensors, 2)) == sorted(fused)
