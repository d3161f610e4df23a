"""``from_dtensor`` on real DTensors: 4 gloo processes, FSDP2, FSDP2 x TP, raw placements."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from planner.layout import Fused
from wbridge.protocol.declarations import decl_from_dict

from .helpers import assemble, check_entries, run_ranks, scatter, to_numpy

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
# 4 gloo processes train and shard models: CPU-bound, so one at a time with the other heavy tests
pytestmark = pytest.mark.heavy


def _load(tmp, kind):
    ranks = []
    for r in range(WORLD):
        d = torch.load(os.path.join(tmp, f"{kind}.rank{r}.pt"))
        ranks.append(({k: (t, decl_from_dict(dd)) for k, (t, dd) in d["entries"].items()}, d["full"]))
    return ranks


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dtensor"))
    run_ranks(os.path.join(HERE, "dtensor_worker.py"), WORLD, [tmp, "plain"], timeout=150)
    return tmp


QWEN2 = dict(vocab=131, hidden=128, heads=4, kv_heads=1, head_dim=32, inter=96, layers=2, qkv_bias=True)


def _to_traced_rollout(ranks):
    """FSDP2 x TP trainer ranks -> traced vLLM-style TP=2 rollout (1 kv head replicated), through
    the planner; checked against the engine's own load_weights of the full tensors."""
    from wbridge.integrations.trace import trace_load_weights

    from .engines import VllmStyleModel, assert_like_loaded, hf_shapes
    from .helpers import plan_transfer

    full = ranks[0][1]
    models = [VllmStyleModel(QWEN2, tp=2, rank=r) for r in range(2)]
    dests = [trace_load_weights(m, m.load_weights, hf_shapes(QWEN2)).bind(m) for m in models]
    plan_transfer([e for e, _ in ranks], dests)
    assert_like_loaded(models, QWEN2, full)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dtensor_trainer_to_traced_rollout(dumps):
    _to_traced_rollout(_load(dumps, "fsdp_tp"))
    _to_traced_rollout(_load(dumps, "fsdp"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_transformers_qwen2_fsdp2_x_tp(tmp_path):
    """The same on the transformers Qwen2 model itself (FSDP2 x TP over its real modules)."""
    pytest.importorskip("transformers")
    run_ranks(os.path.join(HERE, "dtensor_worker.py"), WORLD, [str(tmp_path), "hf"], timeout=380)
    for kind in ("fsdp", "fsdp_tp"):
        ranks = _load(str(tmp_path), kind)
        _check(ranks)
        _to_traced_rollout(ranks)


def _check(ranks):
    full = ranks[0][1]
    checked = 0
    for entries, _ in ranks:
        checked += check_entries(entries, full)
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    rebuilt = assemble([e for e, _ in ranks], shapes, np.float32)
    for k, v in full.items():
        assert np.array_equal(rebuilt[k].view(np.uint32), to_numpy(v).view(np.uint32)), k
    return checked


@pytest.mark.timeout(200)
def test_fsdp2_shard0_uneven(dumps):
    ranks = _load(dumps, "fsdp")
    _check(ranks)
    # 131 embedding rows over 4 ranks: 33, 33, 33, 32 rows.
    rows = [e["model.embed_tokens.weight"][0].shape[0] for e, _ in ranks]
    assert rows == [33, 33, 33, 32]
    offs = [e["model.embed_tokens.weight"][1].offsets[0] for e, _ in ranks]
    assert offs == [0, 33, 66, 99]


@pytest.mark.timeout(200)
def test_fsdp2_x_tp_strided(dumps):
    ranks = _load(dumps, "fsdp_tp")
    _check(ranks)
    # Colwise q_proj under FSDP2 x TP is _StridedShard: rank (dp, tp) holds rows of two runs? No:
    # 128 rows -> tp chunk of 64 -> dp chunk of 32, one run; decls are Shards with the right offsets.
    offs = sorted(e["model.layers.0.self_attn.q_proj.weight"][1].offsets[0] for e, _ in ranks)
    assert offs == [0, 32, 64, 96]
    # Rowwise o_proj: Shard(0) on dp (FSDP2) x Shard(1) on tp.
    decls = [e["model.layers.0.self_attn.o_proj.weight"][1] for e, _ in ranks]
    assert sorted(d.offsets for d in decls) == [(0, 0), (0, 64), (64, 0), (64, 64)]


@pytest.mark.timeout(200)
def test_raw_placements(dumps):
    ranks = _load(dumps, "raw")
    _check(ranks)
    # Shard(1) x Shard(1) over an 11-column tensor: 6 then 5 columns, split again: 3,3 / 3,2.
    widths = [e["b"][0].shape[1] for e, _ in ranks]
    assert sorted(widths) == [2, 3, 3, 3]


@pytest.mark.timeout(200)
def test_dtensor_to_fused_rollout(dumps):
    """Pairing: FSDP2 x TP trainer -> a TP=2 rollout with fused qkv/gate_up (kv heads replicated)."""
    from wbridge.integrations.megatron import gate_up_fused, qkv_fused

    ranks = _load(dumps, "fsdp_tp")
    full = ranks[0][1]
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    canon = assemble([e for e, _ in ranks], shapes, np.float32)
    p = "model.layers.1."
    for tp_rank in range(2):
        qkv = np.full((64 + 32 + 32, 128), np.nan, np.float32)
        gu = np.full((96, 128), np.nan, np.float32)
        entries = {
            "qkv": (
                qkv,
                qkv_fused(
                    p + "self_attn.{}_proj.weight",
                    hidden=128,
                    num_heads=4,
                    num_kv_heads=1,
                    head_dim=32,
                    tp_rank=tp_rank,
                    tp_size=2,
                ),
            ),
            "gate_up": (
                gu,
                gate_up_fused(p + "mlp.{}_proj.weight", hidden=128, intermediate=96, tp_rank=tp_rank, tp_size=2),
            ),
        }
        scatter(entries, canon)
        q = to_numpy(full[p + "self_attn.q_proj.weight"])
        k = to_numpy(full[p + "self_attn.k_proj.weight"])
        v = to_numpy(full[p + "self_attn.v_proj.weight"])
        want = np.concatenate([q[64 * tp_rank : 64 * (tp_rank + 1)], k, v])
        assert np.array_equal(qkv, want)
        g = to_numpy(full[p + "mlp.gate_proj.weight"])
        u = to_numpy(full[p + "mlp.up_proj.weight"])
        assert np.array_equal(
            gu, np.concatenate([g[48 * tp_rank : 48 * (tp_rank + 1)], u[48 * tp_rank : 48 * (tp_rank + 1)]])
        )


@pytest.mark.timeout(200)
def test_strided_shard_two_runs(dumps):
    ranks = _load(dumps, "raw")
    decls = [e["d"][1] for e, _ in ranks]
    # _StridedShard(0, sf=2) over 2 dp ranks: dp rank 0 holds rows 0-1 and 4-5 (two runs).
    assert all(isinstance(d, Fused) for d in decls)
    runs = sorted(tuple(p.offsets[0] for p in d.parts) for d in decls)
    assert runs == [(0, 4), (0, 4), (2, 6), (2, 6)]
