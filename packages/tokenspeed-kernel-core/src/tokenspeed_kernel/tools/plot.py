"""PNG plots of bench results: latency against batch / sequence length, one line per kernel,
one panel per series (full / sliding layers, cache dtype...). matplotlib is optional."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def require_matplotlib():
    """The pyplot module on the Agg backend, or a clear error naming the fix."""
    try:
        import matplotlib  # noqa: PLC0415  (optional dependency, imported only to plot)
    except ImportError as exc:
        raise RuntimeError(
            "bench: the PNG plots need matplotlib (pip install matplotlib), or pass --no-plot"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_op(op: str, rows: list[dict], out_dir: Path, title: str) -> Path | None:
    """One PNG for `op` from result rows (dicts with series, x, xlabel, kernel, latency_us)."""
    timed = [r for r in rows if r["op"] == op and r.get("latency_us")]
    if not timed:
        return None
    plt = require_matplotlib()
    series = sorted({r["series"] for r in timed})
    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.2), squeeze=False)
    for ax, name in zip(axes[0], series, strict=True):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in timed:
            if r["series"] == name:
                lines[r["kernel"]].append((r["x"], r["latency_us"]))
        for kernel, points in sorted(lines.items()):
            points.sort()
            style = "--" if kernel.startswith("peer:") else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=kernel)
        xs = [r["x"] for r in timed if r["series"] == name]
        if min(xs) > 0 and max(xs) >= 4 * min(xs):  # sizes that span octaves
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(next(r["xlabel"] for r in timed if r["series"] == name))
        ax.set_ylabel("latency (µs, median)")
        ax.set_title(f"{op}: {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = out_dir / f"{op}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
