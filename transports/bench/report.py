"""What ``wbridge bench transport`` prints: a table per run (one row per transport and op size),
one JSON object (``--json``), and a chart of bandwidth against op size (``--plot FILE.png``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .units import human

COLUMNS = ("transport", "bytes", "reads", "avg GB/s", "peak GB/s", "p50 us", "p99 us", "checked", "vs raw")


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def row_cells(r: dict) -> list[str]:
    """One printed row of a result row (``transports.bench.client.run_client``'s ``rows``)."""
    raw = r["engine"] == "raw"
    checked = "-" if r["verified"] is None else f"{human(r['checked_bytes'])} {'ok' if r['verified'] else 'BAD'}"
    return [
        r["label"] + (" (raw)" if raw and "raw" not in r["label"] and r["label"] != "iperf3" else ""),
        human(r["op_size"]),
        "-" if r["label"] == "iperf3" else str(r["reads"]),
        _num(r["gbps"], ".3f"),
        _num(r["gbps_peak"], ".3f"),
        _num(r["lat_p50_us"], ".0f"),
        _num(r["lat_p99_us"], ".0f"),
        checked,
        _num(r.get("vs_raw"), ".2f"),
    ]


def table(rows: Sequence[dict]) -> str:
    """The rows as an aligned table; the ``vs raw`` column only where a raw engine was measured."""
    cols = list(COLUMNS) if any("vs_raw" in r for r in rows) else list(COLUMNS[:-1])
    cells = [row_cells(r)[: len(cols)] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, width)))]
    for x in cells:
        lines.append("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(x, width))))
    return "\n".join(lines)


def plot_available() -> str | None:
    """Why ``--plot`` cannot draw here (None: it can)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'wbridge[bench]'"
    return None


def plot(result: dict, path: str, title: str) -> str:
    """``path``: average GB/s against op size, one line per transport (its raw engine dashed, same color)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(dict.fromkeys(r["transport"] for r in rows)):
        for engine in ("wbridge", "raw"):
            mine = [r for r in rows if r["transport"] == name and r["engine"] == engine]
            if mine:
                ax.plot(
                    [r["op_size"] for r in mine],
                    [r["gbps"] for r in mine],
                    marker="o" if engine == "wbridge" else "x",
                    linestyle="-" if engine == "wbridge" else "--",
                    color=colors[i % len(colors)],
                    label=name if engine == "wbridge" else f"{name}: raw {mine[0]['label'].replace('-raw', '')}",
                )
    sizes = sorted({r["op_size"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [human(s).replace("iB", "") for s in sizes], rotation=45 if len(sizes) > 8 else 0)
    ax.set_xlabel("op size (bytes per read)")
    ax.set_ylabel("GB/s (average)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
