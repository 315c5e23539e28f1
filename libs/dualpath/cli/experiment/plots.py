"""PNGs of a testbed run: JCT per mode, SNIC read utilisation over time per node."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dualpath.cli.experiment.analysis import snic_series  # noqa: E402

__all__ = ["plot_jct", "plot_online", "plot_snic"]


_COLOURS = {"basic-nolw": "#e99", "basic": "#c44", "dualpath-rr": "#8ad", "dualpath": "#48c", "oracle": "#4a4"}


def plot_jct(rows: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 3.2))
    names = list(rows)
    ax.bar(names, [rows[n]["jct_s"] for n in names], color=[_COLOURS.get(n, "#888") for n in names])
    ax.set_ylabel("job completion time (s)")
    ax.set_title("offline rollout JCT per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_snic(per_mode: dict, path: Path, slowdown: float = 1.0) -> None:
    """``per_mode``: mode -> (node samples in host seconds, SNIC rate in host bytes/s); the time
    axis is in modeled seconds (host seconds / ``slowdown``)."""
    fig, axes = plt.subplots(len(per_mode), 1, figsize=(7, 2.2 * len(per_mode)), sharex=True, squeeze=False)
    for ax, (mode, (nodes, rate)) in zip(axes[:, 0], per_mode.items()):
        for node, samples in sorted(nodes.items()):
            series = [(t / slowdown, u) for t, u in snic_series(samples, rate) if t >= 0]
            if series:
                ax.plot([t for t, _ in series], [100 * u for _, u in series], label=node, lw=1)
        ax.set_ylabel(f"{mode}\nSNIC read %")
        ax.set_ylim(0, 105)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the agents started")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_online(rows: dict, path: Path, *, slo_ttft: float, title: str = "") -> None:
    """``rows``: mode -> {"probes": [{"rate", "ttft_p50", "ttft_p99", "attainment", "passed"}...],
    "max_aps"}: TTFT p50/p99 and SLO attainment against the arrival rate, one line per mode,
    the SLO and each mode's best rate marked."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.4))
    for mode, row in rows.items():
        pts = sorted((p for p in row["probes"] if p.get("ttft_p50") is not None), key=lambda p: p["rate"])
        if not pts:
            continue
        c = _COLOURS.get(mode, "#888")
        rates = [p["rate"] for p in pts]
        ax.plot(rates, [p["ttft_p50"] for p in pts], "o-", color=c, label=f"{mode} p50")
        ax.plot(rates, [p["ttft_p99"] or float("nan") for p in pts], "x--", color=c, label=f"{mode} p99", lw=1)
        bx.plot(rates, [100 * (p["attainment"] or 0) for p in pts], "o-", color=c, label=mode)
        if row.get("max_aps"):
            bx.axvline(row["max_aps"], color=c, ls=":", lw=1)
    ax.axhline(slo_ttft, color="k", ls=":", lw=1, label="SLO")
    ax.set_yscale("log")
    ax.set_xlabel("agents per second (modeled)")
    ax.set_ylabel("TTFT (s, modeled)")
    ax.legend(fontsize=7)
    bx.set_xlabel("agents per second (modeled)")
    bx.set_ylabel("SLO attainment %")
    bx.set_ylim(0, 105)
    bx.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
