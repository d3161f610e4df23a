"""Extract the rollout layout of Kimi-K2 (1T parameters, DeepseekV3 architecture) at TP=8 x EP=8
without allocating it: trace a two-layer model (one dense, one MoE layer) with two experts per
EP rank at full hidden sizes, then replicate layers and experts by name pattern.

    python tests/correspondence/kimi_extract.py [--ranks 0,1,...] [--check]

Prints one JSON line per rank: trace and expansion time, peak RSS, tensors, pieces, mapped bytes.
``--check`` also verifies, over all 8 ranks, that every canonical element is held by exactly the
expected number of ranks (1 for TP/EP-split tensors, 8 for replicated ones).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from engines import DeepseekStyleModel, deepseek_shapes  # noqa: E402

from planner.compiler import pieces_for  # noqa: E402
from wbridge.integrations.trace import expand_experts, expand_layers, trace_load_weights, with_shapes  # noqa: E402


def kimi_config() -> dict:
    with open(os.path.join(ROOT, "..", "shared", "model-shapes.json")) as f:
        return json.load(f)["kimi-k2"]


def extract(cfg: dict, rank: int, tp: int = 8, ep: int = 8, per_rank_traced: int = 2, max_group_bytes: int = 1 << 30):
    E_small = per_rank_traced * ep
    dense = cfg["first_k_dense_replace"]
    t0 = time.perf_counter()
    small = DeepseekStyleModel(cfg, tp=tp, rank=rank, ep=ep, meta=True, layers=dense + 1, experts=E_small)
    traced = trace_load_weights(
        small,
        small.load_weights,
        deepseek_shapes(cfg, layers=dense + 1, experts=E_small),
        max_group_bytes=max_group_bytes,
    )
    t1 = time.perf_counter()
    E = cfg["n_routed_experts"]
    full_map = list(range(rank * E // ep, (rank + 1) * E // ep))
    res = expand_experts(traced, small.expert_map, full_map)
    layers = {i: (i if i < dense else dense) for i in range(cfg["num_hidden_layers"])}
    res = expand_layers(res, layers)
    res = with_shapes(res, deepseek_shapes(cfg))
    t2 = time.perf_counter()
    return traced, res, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="0")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    cfg = kimi_config()
    shapes = deepseek_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    ranks = list(range(8)) if args.check else [int(r) for r in args.ranks.split(",")]
    held: dict[str, int] = {}
    for rank in ranks:
        traced, res, t_trace, t_expand = extract(cfg, rank)
        big = DeepseekStyleModel(cfg, tp=8, rank=rank, ep=8, meta=True)  # meta: shapes only
        params = dict(big.named_parameters())
        n_pieces = 0
        mapped = 0
        for name, items in res.entries.items():
            shape = tuple(params[name].shape)
            for view, decl in items:
                for p in pieces_for(name, decl, shape[len(view) :]):
                    n_pieces += 1
                    mapped += p.box.numel
                    held[p.tensor] = held.get(p.tensor, 0) + p.box.numel
        print(
            json.dumps(
                {
                    "rank": rank,
                    "trace_s": round(t_trace, 2),
                    "expand_s": round(t_expand, 2),
                    "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                    "traced_params": len(traced.entries),
                    "params": len(res.entries),
                    "pieces": n_pieces,
                    "mapped_params_b": round(mapped / 1e9, 2),
                    "model_params_b": round(total / 1e9, 1),
                    "mapped_bf16_gib": round(2 * mapped / 2**30, 1),
                }
            ),
            flush=True,
        )
    if args.check:
        bad = {}
        for name, shape in shapes.items():
            n = math.prod(shape)
            ratio = held.get(name, 0) / n
            if ratio not in (1.0, 8.0):
                bad[name] = ratio
        print(json.dumps({"checked_tensors": len(shapes), "bad": dict(list(bad.items())[:5]), "n_bad": len(bad)}))
        if bad:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
