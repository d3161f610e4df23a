"""Planner at scale: Megatron-style trainer (256 ranks) -> vLLM/SGLang-style rollout (128 ranks).

Synthetic layouts from the published config shapes in ``benchmarks/model-shapes.json`` (each model's
source, its Hugging Face ``config.json``, is listed there under ``_sources``):

* Trainer, BF16, 256 ranks, Megatron rank order (tp fastest, then dp, then pp). Dense weights are
  TP-split (column-parallel on dim 0, row-parallel on dim 1), replicated over DP; MLP ``linear_fc1``
  is ``[gate_t; up_t]``; Qwen3's ``linear_qkv`` is Megatron's interleaved per-query-group
  ``[q_g; k_g; v_g]`` (MLA models have no QKV fusion: ``q_a``/``kv_a`` are replicated over TP,
  ``q_b``/``kv_b`` column-, ``o_proj`` row-parallel). Experts: ETP=1, EP ranks carved from the
  TP x DP ranks of a stage, one ``[gate_e; up_e]`` and one ``down_e`` tensor per expert
  (SequentialMLP), EDP replicas. Vocabulary split over TP with padding.
* Rollout, BF16, 128 ranks = 8 replicas of TP=16/EP=16: ``qkv_proj`` (GQA, kv heads replicated
  over TP) or MLA's ``fused_qkv_a_proj`` = ``[q_a; kv_a]`` replicated, ``gate_up_proj`` fused,
  experts stacked as ``w13[e] = [gate_e; up_e]`` and ``w2[e] = down_e``, padded vocab.

All 128 rollout ranks are planned together with one ``build_plans`` call. Inside it, rollout
replicas with identical layouts are planned once and the copies get the plan with source ranks
rotated among identical trainer DP replicas (sharing arrays), so the 8 replicas spread over the
replicas; see ``planner/builder.py``.

Prints, per model, a long line and a ``plan_scale: model=... plan_s=... rss_gb=... ops=...
makespan_ratio=... src_imbalance=... src_bound=... sources_per_rank_max=... sources_floor=...``
line: ``src_imbalance`` is the busiest trainer rank's bytes over the mean, ``src_bound`` the least
that ratio can be for these layouts (``planner.bounds.load_bound``), ``sources_per_rank_max`` the
most trainer ranks one rollout rank reads from and ``sources_floor`` the fewest that rank could
(``planner.bounds.min_sources``). Each model runs in its own process so peak RSS is per model (it includes
building the synthetic layouts). Run: ``PYTHONPATH=. .venv/bin/python benchmarks/plan_scale.py
[--models kimi-k2 ...]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

from planner import Fused, LayoutBuilder, RankLayout, Shard, Stack, build_plans
from planner.bounds import load_bound, min_sources
from planner.builder import candidate_demand
from planner.layout import even_split as split
from planner.packing import build_packed_plans, pack_stagings
from planner.simulate import (
    DEFAULT_CONNECT_S,
    DEFAULT_CPU_PER_POST_S,
    DEFAULT_CPU_PER_READ_S,
    DEFAULT_LATENCY_S,
    DEFAULT_NIC_PER_READ_S,
    DEFAULT_QUEUE_DEPTH,
    simulate,
)
from planner.validate import validate_plan

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model-shapes.json")
DT = "bfloat16"
MODELS = ["qwen3-235b-a22b", "deepseek-v3", "kimi-k2"]


@dataclass(frozen=True)
class Trainer:
    tp: int
    pp: int
    dp: int
    ep: int  # expert-parallel size inside one PP stage (ETP = 1); EDP = tp * dp // ep

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


TRAINERS = {
    "qwen3-235b-a22b": Trainer(tp=4, pp=8, dp=8, ep=8),
    "deepseek-v3": Trainer(tp=8, pp=16, dp=2, ep=8),
    "kimi-k2": Trainer(tp=8, pp=16, dp=2, ep=8),
}
ROLLOUT_TP, ROLLOUT_REPLICAS = 16, 8


def rows(name: str, shape: tuple[int, ...], k: int, i: int) -> tuple[tuple[int, ...], Shard]:
    o, s = split(shape[0], k)[i]
    return (s,) + shape[1:], Shard(name, shape, (o,) + (0,) * (len(shape) - 1))


def cols(name: str, shape: tuple[int, int], k: int, i: int) -> tuple[tuple[int, ...], Shard]:
    o, s = split(shape[1], k)[i]
    return (shape[0], s), Shard(name, shape, (0, o))


def fused_rows(names: list[str], shape: tuple[int, int], k: int, i: int) -> tuple[tuple[int, ...], Fused]:
    o, s = split(shape[0], k)[i]
    return (s * len(names), shape[1]), Fused(0, tuple(Shard(n, shape, (o, 0)) for n in names))


def full(b: LayoutBuilder, name: str, shape: tuple[int, ...]) -> None:
    b.add(name, shape, DT, Shard(name, shape))


def vocab(b: LayoutBuilder, name: str, v: int, h: int, k: int, i: int, multiple: int) -> None:
    padded = -(-v // multiple) * multiple
    per = padded // k
    b.add(name, (per, h), DT, Shard(name, (v, h), (i * per, 0), padded=True))


class Model:
    def __init__(self, key: str, cfg: dict) -> None:
        self.key, self.c = key, cfg
        self.h = cfg["hidden_size"]
        self.layers = cfg["num_hidden_layers"]
        self.mla = "kv_lora_rank" in cfg
        self.experts = cfg.get("n_routed_experts", cfg.get("num_experts"))
        self.im = cfg["moe_intermediate_size"]
        self.dense = cfg.get("first_k_dense_replace", 0)
        self.shared = cfg.get("n_shared_experts", 0) * self.im

    def p(self, i: int) -> str:
        return f"model.layers.{i}."

    def _dense_and_shared_mlp(self, b: LayoutBuilder, i: int, k: int, tp: int, local: tuple, dense: str = "") -> bool:
        """Layer ``i``'s dense MLP (returns False: nothing else in it) or its router and shared
        experts (returns True: its routed experts follow), split ``k`` ways, as ``local`` names
        (fused gate/up, down) under the layer's prefix plus ``dense`` (dense) or ``shared_experts.``."""
        p, h, c = self.p(i), self.h, self.c
        parts = []
        if i < self.dense:
            parts.append((p + "mlp.", p + dense, c["intermediate_size"]))
        else:
            full(b, p + "mlp.gate.weight", (self.experts, h))
            if self.mla:
                full(b, p + "mlp.gate.e_score_correction_bias", (self.experts,))
            if self.shared:
                q = p + "mlp.shared_experts."
                parts.append((q, q, self.shared))
        for canon, at, inter in parts:
            lc, decl = fused_rows([canon + "gate_proj.weight", canon + "up_proj.weight"], (inter, h), k, tp)
            b.add(at + local[0], lc, DT, decl)
            lc, decl = cols(canon + "down_proj.weight", (h, inter), k, tp)
            b.add(at + local[1], lc, DT, decl)
        return i >= self.dense

    # -------------------------------------------------------------- trainer (Megatron-style)
    def trainer_rank(self, t: Trainer, pp: int, tp: int, dp: int, rank: int) -> LayoutBuilder:
        b = LayoutBuilder(rank)
        h, c = self.h, self.c
        lo, n = split(self.layers, t.pp)[pp]
        if pp == 0:
            vocab(b, "model.embed_tokens.weight", c["vocab_size"], h, t.tp, tp, 128 * t.tp)
        ep_rank = (dp * t.tp + tp) % t.ep
        e_lo, e_n = split(self.experts, t.ep)[ep_rank]
        for i in range(lo, lo + n):
            p = self.p(i)
            full(b, p + "input_layernorm.weight", (h,))
            full(b, p + "post_attention_layernorm.weight", (h,))
            self._trainer_attn(b, p, t.tp, tp)
            if not self._dense_and_shared_mlp(b, i, t.tp, tp, ("linear_fc1", "linear_fc2")):
                continue
            for e in range(e_lo, e_lo + e_n):
                q = f"{p}mlp.experts.{e}."
                b.add(
                    q + "linear_fc1",
                    (2 * self.im, h),
                    DT,
                    Fused(0, (Shard(q + "gate_proj.weight", (self.im, h)), Shard(q + "up_proj.weight", (self.im, h)))),
                )
                full(b, q + "down_proj.weight", (h, self.im))
        if pp == t.pp - 1:
            full(b, "model.norm.weight", (h,))
            vocab(b, "lm_head.weight", c["vocab_size"], h, t.tp, tp, 128 * t.tp)
        return b

    def _trainer_attn(self, b: LayoutBuilder, p: str, k: int, i: int) -> None:
        h, c = self.h, self.c
        a = p + "self_attn."
        if self.mla:
            full(b, a + "q_a_proj.weight", (c["q_lora_rank"], h))
            full(b, a + "kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h))
            self._mla_tp(b, a, k, i, "linear_proj")
            return
        heads, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        per = heads // kvh
        go, gs = split(kvh, k)[i]
        groups = tuple(
            Fused(
                0,
                (
                    Shard(a + "q_proj.weight", (heads * hd, h), (g * per * hd, 0)),
                    Shard(a + "k_proj.weight", (kvh * hd, h), (g * hd, 0)),
                    Shard(a + "v_proj.weight", (kvh * hd, h), (g * hd, 0)),
                ),
            )
            for g in range(go, go + gs)
        )
        b.add(a + "linear_qkv", (gs, (per + 2) * hd, h), DT, Stack(groups))
        full(b, a + "q_norm.weight", (hd,))
        full(b, a + "k_norm.weight", (hd,))
        local, decl = cols(a + "o_proj.weight", (h, heads * hd), k, i)
        b.add(a + "linear_proj", local, DT, decl)

    def _mla_tp(self, b: LayoutBuilder, a: str, k: int, i: int, o_proj_local: str) -> None:
        """MLA parts both sides share: replicated norms, q_b/kv_b split by heads, o_proj by columns."""
        c = self.c
        heads = c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        full(b, a + "q_a_layernorm.weight", (c["q_lora_rank"],))
        full(b, a + "kv_a_layernorm.weight", (c["kv_lora_rank"],))
        for name, shape in (
            (a + "q_b_proj.weight", (heads * qk, c["q_lora_rank"])),
            (a + "kv_b_proj.weight", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
        ):
            local, decl = rows(name, shape, k, i)
            b.add(name, local, DT, decl)
        local, decl = cols(a + "o_proj.weight", (self.h, heads * c["v_head_dim"]), k, i)
        b.add(a + o_proj_local, local, DT, decl)

    # -------------------------------------------------------------- rollout (vLLM/SGLang-style)
    def rollout_rank(self, tp: int, rank: int) -> LayoutBuilder:
        k = ROLLOUT_TP
        b = LayoutBuilder(rank)
        h, c = self.h, self.c
        vocab(b, "model.embed_tokens.weight", c["vocab_size"], h, k, tp, 64 * k)
        e_lo, e_n = split(self.experts, k)[tp]
        for i in range(self.layers):
            p = self.p(i)
            full(b, p + "input_layernorm.weight", (h,))
            full(b, p + "post_attention_layernorm.weight", (h,))
            self._rollout_attn(b, p, k, tp)
            if not self._dense_and_shared_mlp(b, i, k, tp, ("gate_up_proj", "down_proj"), "mlp."):
                continue
            ex = [f"{p}mlp.experts.{e}." for e in range(e_lo, e_lo + e_n)]
            b.add(
                p + "mlp.experts.w13_weight",
                (e_n, 2 * self.im, h),
                DT,
                Stack(
                    tuple(
                        Fused(
                            0, (Shard(q + "gate_proj.weight", (self.im, h)), Shard(q + "up_proj.weight", (self.im, h)))
                        )
                        for q in ex
                    )
                ),
            )
            b.add(
                p + "mlp.experts.w2_weight",
                (e_n, h, self.im),
                DT,
                Stack(tuple(Shard(q + "down_proj.weight", (h, self.im)) for q in ex)),
            )
        full(b, "model.norm.weight", (h,))
        vocab(b, "lm_head.weight", c["vocab_size"], h, k, tp, 64 * k)
        return b

    def _rollout_attn(self, b: LayoutBuilder, p: str, k: int, i: int) -> None:
        h, c = self.h, self.c
        a = p + "self_attn."
        if self.mla:
            qa = (c["q_lora_rank"], h)
            kva = (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
            b.add(
                a + "fused_qkv_a_proj",
                (qa[0] + kva[0], h),
                DT,
                Fused(0, (Shard(a + "q_a_proj.weight", qa), Shard(a + "kv_a_proj_with_mqa.weight", kva))),
            )
            self._mla_tp(b, a, k, i, "o_proj")
            return
        heads, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        qh = heads // k
        kv = i * kvh // k  # kv heads < TP: each kv head replicated on k / kvh ranks
        b.add(
            a + "qkv_proj",
            ((qh + 2) * hd, h),
            DT,
            Fused(
                0,
                (
                    Shard(a + "q_proj.weight", (heads * hd, h), (i * qh * hd, 0), (qh * hd, h)),
                    Shard(a + "k_proj.weight", (kvh * hd, h), (kv * hd, 0), (hd, h)),
                    Shard(a + "v_proj.weight", (kvh * hd, h), (kv * hd, 0), (hd, h)),
                ),
            ),
        )
        full(b, a + "q_norm.weight", (hd,))
        full(b, a + "k_norm.weight", (hd,))
        local, decl = cols(a + "o_proj.weight", (h, heads * hd), k, i)
        b.add(a + "o_proj", local, DT, decl)


def layouts(key: str) -> tuple[list[RankLayout], list[RankLayout]]:
    """Trainer and rollout layouts; identical ranks share their (immutable) tensor tuples."""
    with open(SHAPES) as f:
        m = Model(key, json.load(f)[key])
    t = TRAINERS[key]
    sources: list[RankLayout] = []
    cache: dict[tuple, RankLayout] = {}
    for pp in range(t.pp):
        for dp in range(t.dp):
            for tp in range(t.tp):
                rank = pp * t.dp * t.tp + dp * t.tp + tp
                # Ranks with the same (pp, tp, EP rank) hold identical bytes: build once.
                key_ = (pp, tp, (dp * t.tp + tp) % t.ep)
                proto = cache.get(key_)
                if proto is None:
                    proto = cache[key_] = m.trainer_rank(t, pp, tp, dp, rank).build()
                sources.append(RankLayout(rank, proto.tensors, proto.specs, proto.region_sizes))
    protos = [m.rollout_rank(tp, tp).build() for tp in range(ROLLOUT_TP)]
    dests = [
        RankLayout(r * ROLLOUT_TP + tp, protos[tp].tensors, protos[tp].specs, protos[tp].region_sizes)
        for r in range(ROLLOUT_REPLICAS)
        for tp in range(ROLLOUT_TP)
    ]
    return sources, dests


def readers(dests: list[RankLayout]) -> list[RankLayout]:
    """The distinct rollout layouts (one per rollout TP rank): what publishers pack their slots for."""
    seen: dict[tuple, RankLayout] = {}
    for d in dests:
        seen.setdefault((d.tensors, d.region_sizes), d)
    return list(seen.values())


def validate_all(plans: dict, sources: list[RankLayout], dests: list[RankLayout], stagings, packed) -> int:
    """Runs ``validate_plan`` (exact-once, in bounds, sampled bytes) on every plan whose reads land
    in place (all of them unless a reader needs a receive buffer); returns how many it checked."""
    srcs = sources if stagings is None else [stagings[s.rank].layout for s in sources]
    cache: dict = {}
    n = 0
    for d in dests:
        if packed is not None and packed[d.rank].recv_bytes:
            continue
        validate_plan(plans[d.rank], srcs, d, cache=cache, samples=64)
        n += 1
    return n


def bounds(sources: list[RankLayout], dests: list[RankLayout]) -> tuple[float, dict[int, int]]:
    """The lower bound of the busiest source's bytes for these layouts, and per rollout rank the
    fewest trainer ranks any exact plan reads from (``planner.bounds``). Candidate sets are the
    same against packed slots (a slot holds its rank's bytes), so the plain layouts serve both."""
    need = candidate_demand(sources, dests)
    total: dict[tuple[int, ...], int] = {}
    for per in need.values():
        for c, b in per.items():
            total[c] = total.get(c, 0) + b
    floor_of: dict[int, int] = {}
    floors = {}
    for r, per in need.items():
        key = id(per)  # identical layouts share their demand dict
        if key not in floor_of:
            floor_of[key] = min_sources(per)
        floors[r] = floor_of[key]
    return load_bound(total, (s.rank for s in sources)), floors


def run_one(key: str, args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    gc.disable()  # building millions of small layout objects; nothing cyclic to collect
    sources, dests = layouts(key)
    gc.enable()
    t1 = time.perf_counter()
    c1 = time.process_time()
    pack_s = 0.0
    slot_ratio = 1.0
    if args.zero_copy:
        plans = build_plans(sources, dests)
        recv = scatter = 0
    else:
        stagings = pack_stagings(sources, readers(dests))
        pack_s = time.perf_counter() - t1
        packed = build_packed_plans(list(stagings.values()), dests)
        plans = {r: pp.plan for r, pp in packed.items()}
        recv = max(pp.recv_bytes for pp in packed.values())
        scatter = max(len(pp.scatter) for pp in packed.values())
        slot_ratio = max(stagings[s.rank].layout.region_sizes[0] / s.region_sizes[0] for s in sources)
    t2 = time.perf_counter()
    c2 = time.process_time()
    sim = simulate(
        plans,
        bandwidth=args.bandwidth,
        latency_s=args.latency,
        queue_depth=args.depth,
        cpu_per_read_s=args.cpu_per_read,
        cpu_per_post_s=args.cpu_per_post,
        nic_per_read_s=args.nic_per_read,
        connect_s=args.connect,
    )
    t3 = time.perf_counter()
    reads = [len(p) for p in plans.values()]
    loads: dict[int, int] = {}
    for p in plans.values():
        for r, v in p.bytes_per_source().items():
            loads[r] = loads.get(r, 0) + v
    mean = sum(loads.values()) / len(sources)
    t4 = time.perf_counter()
    validated = validate_all(
        plans, sources, dests, None if args.zero_copy else stagings, packed if not args.zero_copy else None
    )
    src_bound, floors = bounds(sources, dests)
    n_src = {r: len(p.sources) for r, p in plans.items()}
    worst = max(n_src.values())
    return {
        "src_bound": src_bound / mean,
        "sources_per_rank_max": worst,
        "sources_floor": min(floors[r] for r, n in n_src.items() if n == worst),
        "sources_over_floor_max": max(n / floors[r] for r, n in n_src.items()),
        "bounds_s": time.perf_counter() - t4,
        "validated": validated,
        "model": key,
        "layout_s": t1 - t0,
        "plan_s": t2 - t1,
        "pack_s": pack_s,
        "slot_ratio": slot_ratio,
        "recv_bytes_max": recv,
        "scatter_per_rank_max": scatter,
        "plan_cpu_s": c2 - c1,
        "sim_s": t3 - t2,
        "load_avg": os.getloadavg()[0],
        "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "ops": sum(reads),
        "reads_per_rank_max": max(reads),
        "reads_per_rank_mean": sum(reads) / len(reads),
        "bytes": sim.total_bytes,
        "makespan_s": sim.makespan_s,
        "lower_bound_s": sim.lower_bound_s,
        "makespan_ratio": sim.ratio,
        "src_max_over_mean": max(loads.values()) / mean,
        "sources_used": len(loads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS, help="the models to plan (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth", type=float, default=50e9, help="per-rank NIC bytes/s (default 50 GB/s)")
    ap.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S, help="per-read round trip in seconds")
    ap.add_argument(
        "--depth", type=int, default=DEFAULT_QUEUE_DEPTH, help="outstanding reads per (source, destination) pair"
    )
    ap.add_argument(
        "--cpu-per-read", type=float, default=DEFAULT_CPU_PER_READ_S, help="reader CPU seconds to post one read"
    )
    ap.add_argument(
        "--cpu-per-post", type=float, default=DEFAULT_CPU_PER_POST_S, help="reader CPU seconds per post (read call)"
    )
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="plan against the trainers' own layouts (staging=ZeroCopy()) instead of reader-ordered slots",
    )
    ap.add_argument("--nic-per-read", type=float, default=DEFAULT_NIC_PER_READ_S, help="fixed NIC seconds per read")
    ap.add_argument(
        "--connect", type=float, default=DEFAULT_CONNECT_S, help="seconds to set up one reader's connection to a source"
    )
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return
    for key in args.models:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            key,
            "--bandwidth",
            str(args.bandwidth),
            "--latency",
            str(args.latency),
            "--depth",
            str(args.depth),
            "--cpu-per-read",
            str(args.cpu_per_read),
            "--nic-per-read",
            str(args.nic_per_read),
            "--cpu-per-post",
            str(args.cpu_per_post),
            "--connect",
            str(args.connect),
            *(["--zero-copy"] if args.zero_copy else []),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"{r['model']}: layouts {r['layout_s']:.1f}s, plan {r['plan_s']:.2f}s (packing {r['pack_s']:.2f}s) "
            f"(CPU {r['plan_cpu_s']:.2f}s, load average {r['load_avg']:.1f}), peak RSS {r['rss_gb']:.2f} GB, "
            f"ops {r['ops']} (per rollout rank max {r['reads_per_rank_max']}), "
            f"bytes {r['bytes'] / 1e12:.2f} TB, makespan {r['makespan_s']:.3f}s, "
            f"lower bound {r['lower_bound_s']:.3f}s, ratio {r['makespan_ratio']:.4f}, "
            f"source bytes max/mean {r['src_max_over_mean']:.4f} over {r['sources_used']} ranks "
            f"(lower bound {r['src_bound']:.4f}), sources per rollout rank max {r['sources_per_rank_max']} "
            f"(fewest possible {r['sources_floor']}; sources/fewest max {r['sources_over_floor_max']:.2f}), "
            f"exact-once checked on {r['validated']} plans (with bounds: {r['bounds_s']:.1f}s) "
            f"(simulated in {r['sim_s']:.1f}s); "
            + (
                "zero-copy: reads from the trainers' own layouts"
                if args.zero_copy
                else f"reader-ordered slots: slot/plain bytes max {r['slot_ratio']:.4f}, receive buffer max "
                f"{r['recv_bytes_max'] / 2**20:.1f} MiB, scatter copies per rank max {r['scatter_per_rank_max']}"
            ),
            flush=True,
        )
        print(
            f"plan_scale: model={r['model']} plan_s={r['plan_s']:.3f} rss_gb={r['rss_gb']:.3f} "
            f"ops={r['ops']} reads_per_rank_max={r['reads_per_rank_max']} "
            f"reads_per_rank_mean={r['reads_per_rank_mean']:.1f} makespan_ratio={r['makespan_ratio']:.4f} "
            f"src_imbalance={r['src_max_over_mean']:.4f} src_bound={r['src_bound']:.4f} "
            f"sources_per_rank_max={r['sources_per_rank_max']} sources_floor={r['sources_floor']}",
            flush=True,
        )


if __name__ == "__main__":
    main()
