"""Rollout layouts traced from vLLM-style loaders; trainer layouts from the Megatron helpers;
bit-exact transfers between them through the planner; failing checks that name the parameter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from planner.layout import Fused, Shard, Stack
from wbridge.errors import LayoutError
from wbridge.integrations.megatron import qkv_fused
from wbridge.integrations.trace import (
    TraceResult,
    cache_key,
    cached_trace,
    check_declarations,
    expand_experts,
    expand_layers,
    trace_load_weights,
    with_shapes,
)

from .engines import VllmStyleModel, hf_shapes
from .helpers import check_entries, plan_transfer, to_numpy
from .megatron_ref import megatron_config, megatron_rank_tensors

# GQA with 1 kv head < TP=2 (kv heads replicated on the rollout side); vocab 131 (padded).
DENSE = dict(vocab=131, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=48, layers=2)
DENSE_GQA1 = dict(DENSE, kv_heads=1)
MOE = dict(DENSE, experts=4, moe_inter=32, first_moe=1)


def full_weights(cfg, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in hf_shapes(cfg).items()}


def reference_engine(cfg, full, **kw):
    """The engine loaded by its own load_weights from full tensors: the ground truth."""
    m = VllmStyleModel(cfg, **kw)
    m.load_weights(full.items())
    return m


def rollout_entries(cfg, tp, rank, ep=1):
    m = VllmStyleModel(cfg, tp=tp, rank=rank, ep=ep)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7.0)
    res = trace_load_weights(m, m.load_weights, hf_shapes(cfg))
    return m, res


def assert_same_params(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for k in pa:
        x, y = to_numpy(pa[k]), to_numpy(pb[k])
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), k


def test_traced_declarations_dense():
    _, r = rollout_entries(DENSE_GQA1, tp=2, rank=1)
    qkv = r.entries["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv == (
        (
            (),
            qkv_fused(
                "model.layers.0.self_attn.{}_proj.weight",
                hidden=64,
                num_heads=4,
                num_kv_heads=1,
                head_dim=16,
                tp_rank=1,
                tp_size=2,
            ),
        ),
    )
    emb = r.entries["model.embed_tokens.weight"][0][1]
    # 131 rows padded to 64 * tp = 256: rank 1 holds rows 128..255, of which 3 are real.
    assert emb == Shard("model.embed_tokens.weight", (131, 64), (128, 0), padded=True)
    assert r.unmapped["model.embed_tokens.weight"] == (128 - 3) * 64
    # every parameter element is mapped or reported unmapped
    assert set(r.entries) == {n for n, _ in VllmStyleModel(DENSE_GQA1, tp=2, rank=1).named_parameters()}


@pytest.mark.parametrize("cfg,tp,ep", [(DENSE, 2, 1), (DENSE_GQA1, 2, 1), (MOE, 2, 2)], ids=["dense", "gqa1", "moe"])
@pytest.mark.timeout(120)
def test_megatron_trainer_to_traced_rollout(cfg, tp, ep):
    """Megatron TP=2 (EP=2 for experts) trainer -> traced vLLM-style rollout at TP=2 (and TP=1)."""
    full = full_weights(cfg)
    kv_tp = min(tp, cfg["kv_heads"])  # Megatron needs query groups divisible by TP
    mtp = kv_tp
    sources = []
    for r in range(mtp * ep):
        tr, er = r % mtp, r // mtp
        tensors = megatron_rank_tensors(full, cfg, tr, mtp, er, ep)
        entries = megatron_config(cfg, tr, mtp, er, ep).entries(tensors)
        check_entries(entries, full)
        sources.append(entries)
    for rtp in (tp, 1):
        rollouts = [rollout_entries(cfg, rtp, r, ep=rtp if cfg.get("experts") else 1) for r in range(rtp)]
        dests = [res.bind(m) for m, res in rollouts]
        plan_transfer(sources, dests)
        for r, (m, _) in enumerate(rollouts):
            ref = reference_engine(cfg, full, tp=rtp, rank=r, ep=rtp if cfg.get("experts") else 1)
            for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
                lay = rollouts[r][1].unmapped.get(n)
                if lay:  # vocabulary padding: compare only the mapped rows
                    rows = min(p.shape[0], cfg["vocab"] - r * p.shape[0])
                    p, q = p[: max(rows, 0)], q[: max(rows, 0)]
                assert torch.equal(p, q), f"rank {r}: {n}"


def test_megatron_pp_stage_and_padding():
    cfg = dict(DENSE, layers=4)
    full = full_weights(cfg)
    for pp_rank in range(2):
        t = megatron_rank_tensors(full, cfg, 1, 2, pp_rank=pp_rank, pp=2)
        entries = megatron_config(cfg, 1, 2, pp_rank=pp_rank, pp=2).entries(t)
        assert check_entries(entries, full) > 0
        names = {s.name for _, d in entries.values() for s in ([d] if isinstance(d, Shard) else d.parts)}
        assert all(
            f"layers.{2 * pp_rank}." in n or f"layers.{2 * pp_rank + 1}." in n or "layers" not in n for n in names
        )
    # Megatron pads the vocabulary to 128 * tp = 256 rows: rank 1 holds rows 128..255, only 3 real.
    shape, decl = megatron_config(cfg, 1, 2).params()["embedding.word_embeddings.weight"]
    assert shape == (128, 64) and decl == Shard("model.embed_tokens.weight", (131, 64), (128, 0), padded=True)
    with pytest.raises(LayoutError, match="decoder.layers.0.self_attention.linear_proj.weight"):
        bad = megatron_rank_tensors(full, cfg, 0, 2, pp_rank=0, pp=2)
        bad["decoder.layers.0.self_attention.linear_proj.weight"] = torch.zeros(3, 3)
        megatron_config(cfg, 0, 2, pp_rank=0, pp=2).entries(bad)


# --- failing checks -------------------------------------------------------------------------


def test_wrong_fusion_order_is_reported():
    m = VllmStyleModel(DENSE, tp=2, rank=0, qkv_order="kqv")
    traced = trace_load_weights(m, m.load_weights, hf_shapes(DENSE))
    declared = {
        f"model.layers.{i}.self_attn.qkv_proj.weight": qkv_fused(
            f"model.layers.{i}.self_attn.{{}}_proj.weight",
            hidden=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            tp_rank=0,
            tp_size=2,
        )
        for i in range(2)
    }
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight: declared layout differs"):
        check_declarations(declared, traced, shapes)
    good = VllmStyleModel(DENSE, tp=2, rank=0)
    check_declarations(declared, trace_load_weights(good, good.load_weights, hf_shapes(DENSE)), shapes)


def test_scaled_copy_is_reported():
    m = VllmStyleModel(DENSE, tp=2, rank=0, scale=2.0)
    with pytest.raises(LayoutError, match=r"model\.embed_tokens\.weight: .*transforms values"):
        trace_load_weights(m, m.load_weights, hf_shapes(DENSE))


def test_missing_tensor_is_reported():
    m = VllmStyleModel(DENSE, tp=2, rank=0, skip=("layers.1.mlp.up_proj",))
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight: load_weights left 1536"):
        trace_load_weights(m, m.load_weights, hf_shapes(DENSE))
    m = VllmStyleModel(DENSE, tp=2, rank=0, skip=("model.norm",))
    with pytest.raises(LayoutError, match=r"model\.norm\.weight: load_weights wrote nothing"):
        trace_load_weights(m, m.load_weights, hf_shapes(DENSE))


def test_permutation_is_reported():
    m = VllmStyleModel(DENSE, tp=1, rank=0)
    inner = m.load_weights

    def transposing(weights):
        inner((n, w.t().contiguous().t() if "o_proj" not in n else w) for n, w in weights)
        with torch.no_grad():  # a loader that stores o_proj rows in reverse order
            for i in range(2):
                p = m.model.layers[i].self_attn.o_proj.weight
                p.data.copy_(p.data.flip(0))

    with pytest.raises(LayoutError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: the loader reorders"):
        trace_load_weights(m, transposing, hf_shapes(DENSE))


def test_loader_error_is_wrapped():
    m = VllmStyleModel(DENSE, tp=2, rank=0)
    shapes = dict(hf_shapes(DENSE))
    shapes["model.layers.0.self_attn.q_proj.weight"] = (3, 3)
    with pytest.raises(LayoutError, match="load_weights failed while tracing"):
        trace_load_weights(m, m.load_weights, shapes)


# --- caching and replication by pattern ---------------------------------------------------------


def test_json_cache_roundtrip(tmp_path):
    m = VllmStyleModel(MOE, tp=2, rank=1, ep=2)
    calls = []

    def run():
        calls.append(1)
        return trace_load_weights(m, m.load_weights, hf_shapes(MOE))

    key = cache_key(MOE, "vllm-style", "0", rank=1, tp=2, ep=2)
    assert key != cache_key(MOE, "vllm-style", "0", rank=0, tp=2, ep=2)
    a = cached_trace(str(tmp_path), key, run)
    b = cached_trace(str(tmp_path), key, run)
    assert len(calls) == 1 and a.entries == b.entries and a.unmapped == b.unmapped
    assert TraceResult.from_json(a.to_json()).entries == a.entries
    json.loads(a.to_json())


def test_expand_layers_and_experts_match_full_trace():
    big = dict(MOE, layers=5, experts=8)
    small = dict(MOE, layers=2, experts=4)  # layer 0 dense, layer 1 MoE; 2 experts per rank
    for rank in range(2):
        ms = VllmStyleModel(small, tp=2, rank=rank, ep=2)
        rs = trace_load_weights(ms, ms.load_weights, hf_shapes(small))
        rs = expand_experts(rs, ms.expert_map, list(range(rank * 4, rank * 4 + 4)))
        rs = expand_layers(rs, {0: 0, **{i: 1 for i in range(1, 5)}})
        rs = with_shapes(rs, hf_shapes(big))
        mb = VllmStyleModel(big, tp=2, rank=rank, ep=2, meta=True)
        rb = trace_load_weights(mb, mb.load_weights, hf_shapes(big))
        assert rs.entries == rb.entries
        assert rs.unmapped == rb.unmapped


def test_meta_module_traced_without_allocating_it():
    m = VllmStyleModel(MOE, tp=2, rank=0, ep=2, meta=True)
    r = trace_load_weights(m, m.load_weights, hf_shapes(MOE))
    assert all(p.device.type == "meta" for p in m.parameters())
    w13 = r.entries["model.layers.1.mlp.experts.w13_weight"]
    assert [v for v, _ in w13] == [(0,), (1,)]
    assert isinstance(w13[0][1], Fused)
    assert isinstance(r.entries["model.layers.1.mlp.experts.w2_weight"][0][1], Stack)


def test_groups_and_parking_leave_real_weights_alone():
    m = VllmStyleModel(MOE, tp=2, rank=0, ep=2)
    full = full_weights(MOE)
    m.load_weights(full.items())
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    whole = trace_load_weights(m, m.load_weights, hf_shapes(MOE))
    grouped = trace_load_weights(m, m.load_weights, hf_shapes(MOE), max_group_bytes=40_000)
    assert grouped.entries == whole.entries and grouped.unmapped == whole.unmapped
    part = trace_load_weights(m, m.load_weights, hf_shapes(MOE), params=["model.norm.weight"])
    assert list(part.entries) == ["model.norm.weight"]
    for n, p in m.named_parameters():  # placeholders never reached the real weights
        assert torch.equal(p, before[n]) and p.dtype == torch.float32, n


def test_deepseek_style_replication_matches_full_trace():
    """The Kimi-K2 extraction recipe (kimi_extract.py) on a small DeepseekV3-architecture config:
    a two-layer, two-experts-per-rank trace expanded by name pattern equals the full trace."""
    from .engines import DeepseekStyleModel, deepseek_shapes

    c = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=16,
        n_shared_experts=1,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    tp = ep = 4
    for rank in (0, 3):
        small = DeepseekStyleModel(c, tp=tp, rank=rank, ep=ep, layers=2, experts=2 * ep)
        r = trace_load_weights(small, small.load_weights, deepseek_shapes(c, layers=2, experts=2 * ep))
        r = expand_experts(r, small.expert_map, list(range(rank * 4, rank * 4 + 4)))
        r = with_shapes(expand_layers(r, {0: 0, 1: 1, 2: 1, 3: 1}), deepseek_shapes(c))
        full = DeepseekStyleModel(c, tp=tp, rank=rank, ep=ep)
        want = trace_load_weights(full, full.load_weights, deepseek_shapes(c))
        assert r.entries == want.entries and r.unmapped == want.unmapped
