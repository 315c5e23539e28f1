"""PNGs of a simulated run (JCT per mode, SNIC read utilisation over time per node) and of the
paper table (simulated over paper figure, per row)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_jct", "plot_paper", "plot_snic"]

_COLOURS = {"basic-nolw": "#e99", "basic": "#c44", "dualpath-rr": "#8ad", "dualpath": "#48c", "oracle": "#4a4"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_jct(rows: dict, path: Path, title: str = "offline rollout JCT per mode (simulated)") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 3.2))
    names = list(rows)
    ax.bar(names, [rows[n]["jct_s"] for n in names], color=[_COLOURS.get(n, "#888") for n in names])
    ax.set_ylabel("job completion time (s)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_snic(rows: dict, path: Path, max_lines: int = 12) -> None:
    """One panel per mode: each node's SNIC read utilisation (%) over virtual time."""
    plt = _plt()
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 2.2 * len(rows)), sharex=True, squeeze=False)
    for ax, (mode, row) in zip(axes[:, 0], rows.items()):
        series = row["snic_series"]
        width = series["bin_s"]
        for node, util in sorted(series["utilisation"].items())[:max_lines]:
            ax.plot([(i + 0.5) * width for i in range(len(util))], [100 * u for u in util], label=node, lw=1)
        ax.set_ylabel(f"{mode}\nSNIC read %")
        ax.set_ylim(0, 105)
        ax.legend(loc="upper right", fontsize=6, ncol=2)
    axes[-1, 0].set_xlabel("virtual seconds since the agents started")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_paper(rows: list[dict], path: Path, title: str = "dualpath sim paper: simulated / paper figure") -> None:
    """A dot per row of ``dualpath sim paper``: sim / paper on a log axis, the +-15% band shaded;
    rows outside it (or outside the paper's range, drawn as a bar) in red."""
    plt = _plt()
    rows = [r for r in rows if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(7.5, 0.26 * len(rows) + 1.2))
    ys = list(range(len(rows)))[::-1]
    ax.axvspan(0.85, 1.15, color="#dde8f4", zorder=0, label="within 15%")
    ax.axvline(1.0, color="#48c", lw=0.8, zorder=1)
    for y, r in zip(ys, rows):
        color = "#2a7" if r["within"] else "#c33"
        if r.get("range"):  # the paper gives a range: a bar over it, relative to its middle
            lo, hi = r["range"]
            ax.plot([lo / r["paper"], hi / r["paper"]], [y, y], color=color, lw=4, alpha=0.35, solid_capstyle="butt", zorder=2)
        ax.plot([r["ratio"]], [y], "o", ms=5, color=color, zorder=3)
    ax.set_yticks(ys)
    ax.set_yticklabels([r["name"] for r in rows], fontsize=7)
    ax.set_xscale("log")
    lo, hi = min(0.08, min(r["ratio"] for r in rows) * 0.8), max(5.0, max(r["ratio"] for r in rows) * 1.25)
    ax.set_xlim(lo, hi)
    ax.set_xticks([0.1, 0.25, 0.5, 1.0, 2.0, 4.0])
    ax.get_xaxis().set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("simulated / paper (ratio rows: sim ratio / paper ratio)\na bar: the paper's range over its middle", fontsize=9)
    inside = sum(r["within"] for r in rows)
    ax.set_title(f"{title} ({inside} of {len(rows)} within)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
