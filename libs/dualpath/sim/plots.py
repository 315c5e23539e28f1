"""PNGs of a simulated run: JCT per mode, SNIC read utilisation over time per node."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_jct", "plot_snic"]

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
