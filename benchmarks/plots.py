"""Charts of the benchmark results (matplotlib, the ``bench`` extra), written to ``benchmarks/results/``.

    python benchmarks/plots.py            # redraw from results/update_e2e.json and results/stall.json
    python benchmarks/plots.py --sweep    # also measure throughput against op size per transport

``update_e2e.py --plot`` and ``stall.py --plot`` draw their own chart after a run. The sweep reads
a 64 MiB region from a serving process with ``transports.bench.run_bench`` at each op size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from _common import RESULTS_DIR, machine, write_json

OP_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
WBRIDGE, BASELINE, OTHER = "#1f77b4", "#d62728", "#7f7f7f"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _machine_note(m: Mapping[str, Any]) -> str:
    return f"{m.get('cpus')} CPUs, loopback, {m.get('utc', '')} UTC"


def _save(fig, name: str, out_dir: str | None = None) -> str:
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path


def plot_update(data: Mapping[str, Any], name: str = "update_e2e.png", out_dir: str | None = None) -> str:
    """update_e2e.png: median update time per method, and trainer-0 peak RSS."""
    plt = _plt()
    methods = data["summary"]["methods"]
    names = list(methods)
    times = [methods[n]["update_s"] for n in names]
    colors = [BASELINE if not n.startswith("wbridge") else WBRIDGE for n in names]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    y = range(len(names))
    ax.barh(y, times, color=colors)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("full update, seconds (median)")
    for i, n in enumerate(names):
        ax.text(
            times[i], i, f" {times[i]:.2f}s ({methods[n]['speedup_vs_gather_bcast']:.1f}x)", va="center", fontsize=8
        )
    ax.set_xlim(0, max(times) * 1.35)
    mib = data["config"]["model_bytes"] / 2**20
    ax.set_title(f"{mib:.0f} MiB bf16 model, 4 trainers (TP2xDP2) -> 2 rollouts (TP2, fused)", fontsize=9)
    rss = data["summary"]["rss_mib"]
    labels = {"wbridge": "wbridge\nzero copy", "wbridge-staged": "wbridge\nstaged", "gather-bcast": "gather-\nbcast"}
    keys = [k for k in ("wbridge", "wbridge-staged", "gather-bcast") if k in rss]
    vals = [rss[k]["trainer0_mib"] for k in keys]
    ax2.bar(range(len(keys)), vals, color=[BASELINE if k == "gather-bcast" else WBRIDGE for k in keys])
    ax2.set_xticks(range(len(keys)), [labels[k] for k in keys], fontsize=8)
    for i, v in enumerate(vals):
        ax2.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax2.set_ylabel("trainer rank 0 peak RSS, MiB")
    ax2.set_ylim(0, max(vals) * 1.15)
    fig.suptitle(f"update_e2e ({_machine_note(data['machine'])})", fontsize=9)
    fig.tight_layout()
    return _save(fig, name, out_dir)


def plot_stall(data: Mapping[str, Any], out_dir: str | None = None) -> str:
    """stall.png: average stall per step of trainers and rollouts per mode (log scale)."""
    plt = _plt()
    modes = data["modes"]
    names = list(modes)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.38
    floor = 1e-1  # ms: a stall of zero still needs a visible bar on a log axis
    for j, (key, label, color) in enumerate(
        (("trainer_stall_s", "trainers", "#1f77b4"), ("rollout_stall_s", "rollouts", "#ff7f0e"))
    ):
        vals = [max(modes[n][key] * 1e3, floor) for n in names]
        xs = [i + (j - 0.5) * width for i in range(len(names))]
        ax.bar(xs, vals, width, label=label, color=color)
    ax.set_yscale("log")
    ax.set_ylabel("average stall per step, ms (log)")
    ax.set_xticks(range(len(names)), names)
    top = max(max(modes[n]["trainer_stall_s"], modes[n]["rollout_stall_s"]) for n in names) * 1e3
    for i, n in enumerate(names):
        ax.text(
            i,
            top * 1.6,
            f"{modes[n]['stall_s'] * 1e3:.0f} ms avg\n{modes[n]['vs_baseline']:.1f}x",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(floor * 0.8, top * 12)
    cfg = data["config"]
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(
        f"stall per step ({cfg['model_bytes'] / 2**20:.0f} MiB model, {cfg['steps']} steps of "
        f"{cfg['train_s']}s train / {cfg['gen_s']}s generate, pull {cfg['pull']})\n"
        f"{_machine_note(data['machine'])}",
        fontsize=8,
    )
    fig.tight_layout()
    return _save(fig, "stall.png", out_dir)


def sweep(names: list[str], size: int = 64 << 20, repeat: int = 3) -> dict:
    """run_bench at each op size for each transport (local through memfd, as a staged publisher serves)."""
    from transports.bench import run_bench

    rows = []
    for name in names:
        for op in OP_SIZES:
            res = run_bench(name, size, op, repeat=repeat)
            if not res["verified"]:
                raise RuntimeError(f"sweep {name} op {op}: bytes not verified")
            rows.append({"transport": name, "op_size": op, "gbps": res["gbps"], "gbps_best": res["gbps_best"]})
            print(f"  {name:>9} op {op >> 10:>6} KiB: {res['gbps']:.2f} GB/s", file=sys.stderr, flush=True)
    return {"size": size, "repeat": repeat, "rows": rows, "machine": machine()}


def plot_throughput(data: Mapping[str, Any]) -> str:
    """throughput.png: GB/s against op size, one line per transport."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name in dict.fromkeys(r["transport"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["transport"] == name]
        ax.plot([r["op_size"] for r in rows], [r["gbps"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(OP_SIZES, [f"{s >> 10}K" if s < 1 << 20 else f"{s >> 20}M" for s in OP_SIZES])
    ax.set_xlabel("op size (bytes per read)")
    ax.set_ylabel("GB/s (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    ax.set_title(
        f"one reader, {data['size'] >> 20} MiB region, 4 streams where a transport takes them,\n"
        f"local through memfd ({_machine_note(data['machine'])})",
        fontsize=8,
    )
    fig.tight_layout()
    return _save(fig, "throughput.png")


def markdown(update: Mapping[str, Any] | None, stall: Mapping[str, Any] | None) -> str:
    """The results tables of docs/benchmarks.md, from the JSON files."""
    out = []
    if update:
        s = update["summary"]
        out += [
            "| method | update s (median) | vs gather-bcast | GB/s | pull window s | efficiency |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, m in s["methods"].items():
            extra = (
                f"{m['update_gbps']:.2f} | {m['pull_window_s']:.3f} | {m['efficiency']:.2f}"
                if "efficiency" in m
                else " | | "
            )
            out.append(f"| {name} | {m['update_s']:.3f} | {m['speedup_vs_gather_bcast']:.2f}x | {extra} |")
        out += [
            "",
            "| bare transport (2 readers x 2 sources) | GB/s together | GB/s, one reader alone |",
            "|---|---:|---:|",
        ]
        for name, b in update["bench"].items():
            out.append(f"| {name} | {b['gbps']:.2f} | {b['solo_gbps']:.2f} |")
        out += ["", "| peak RSS, MiB | trainer rank 0 | rollout rank 0 |", "|---|---:|---:|"]
        for label, r in s["rss_mib"].items():
            out.append(f"| after {label} | {r['trainer0_mib']:.0f} | {r['rollout0_mib']:.0f} |")
        out.append("")
    if stall:
        out += [
            "| mode | trainer stall ms/step | rollout stall ms/step | all, ms/step | s/step | vs baseline |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, m in stall["modes"].items():
            out.append(
                f"| {name} | {m['trainer_stall_s'] * 1e3:.1f} | {m['rollout_stall_s'] * 1e3:.1f} | "
                f"{m['stall_s'] * 1e3:.1f} | {m['step_wall_s']:.2f} | {m['vs_baseline']:.2f}x |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plots", description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="measure throughput against op size first")
    ap.add_argument("--transports", default=None, help="for --sweep; default: every available transport")
    ap.add_argument("--markdown", action="store_true", help="print the results as markdown tables instead")
    a = ap.parse_args(argv)
    if a.markdown:
        loaded = []
        for name in ("update_e2e.json", "stall.json"):
            path = os.path.join(RESULTS_DIR, name)
            loaded.append(json.load(open(path)) if os.path.exists(path) else None)
        print(markdown(*loaded))
        return 0
    if a.sweep:
        import transports

        names = a.transports.split(",") if a.transports else transports.available()
        write_json("throughput.json", sweep(names))
    for name in sorted(os.listdir(RESULTS_DIR)) if os.path.isdir(RESULTS_DIR) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(RESULTS_DIR, name)) as f:
            data = json.load(f)
        if name.startswith("update_e2e"):  # update_e2e.py --name update_e2e_all: one chart per file
            print(os.path.relpath(plot_update(data, name.removesuffix(".json") + ".png")))
        elif name == "stall.json":
            print(os.path.relpath(plot_stall(data)))
        elif name == "throughput.json":
            print(os.path.relpath(plot_throughput(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
