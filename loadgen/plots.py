"""PNG plots of a run (TTFT and TPOT CDFs) and of a sweep (latency and attainment vs APS)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display

import matplotlib.pyplot as plt  # noqa: E402  (must follow the backend choice)
import numpy as np  # noqa: E402

from loadgen.report import TurnRecord  # noqa: E402

__all__ = ["plot_run", "plot_sweep"]


def _cdf(ax, values: list[float], bound: float, label: str) -> None:
    if values:
        x = np.sort(np.asarray(values))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), drawstyle="steps-post")
    ax.axvline(bound, color="red", linestyle="--", label=f"SLO {bound:g} s")
    ax.set_xlabel(f"{label} (s)")
    ax.set_ylabel("fraction of turns")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def plot_run(out_dir: str | Path, turns: list[TurnRecord], *, slo_ttft: float, slo_tpot: float) -> list[Path]:
    """Write ttft_cdf.png and tpot_cdf.png into ``out_dir``; returns their paths.

    Raises OSError when the files cannot be written.
    """
    out = Path(out_dir)
    paths = []
    for name, values, bound in (
        ("ttft", [t.ttft for t in turns if t.ok and t.ttft is not None], slo_ttft),
        ("tpot", [t.tpot for t in turns if t.ok and t.tpot is not None], slo_tpot),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        _cdf(ax, values, bound, name.upper())
        ax.set_title(f"{name.upper()} CDF ({len(values)} turns)")
        path = out / f"{name}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_sweep(out_dir: str | Path, points: list[dict], *, slo_ttft: float, slo_tpot: float, target: float) -> list[Path]:
    """Write sweep_latency.png and sweep_attainment.png (one marker per probe).

    ``points`` carry rate, ttft_p50, ttft_p99, tpot_p50, tpot_p99 and attainment.
    Raises OSError when the files cannot be written.
    """
    out = Path(out_dir)
    pts = sorted(points, key=lambda p: p["rate"])
    rates = [p["rate"] for p in pts]

    def col(key: str) -> list[float]:
        return [np.nan if p.get(key) is None else p[key] for p in pts]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, bound in ((a1, "ttft", slo_ttft), (a2, "tpot", slo_tpot)):
        ax.plot(rates, col(f"{metric}_p50"), "o-", label="p50")
        ax.plot(rates, col(f"{metric}_p99"), "s-", label="p99")
        ax.axhline(bound, color="red", linestyle="--", label="SLO")
        ax.set_xlabel("arrival rate (agents/s)")
        ax.set_ylabel(f"{metric.upper()} (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    latency = out / "sweep_latency.png"
    fig.savefig(latency, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, col("attainment"), "o-")
    ax.axhline(target, color="red", linestyle="--", label=f"target {target:.0%}")
    ax.set_xlabel("arrival rate (agents/s)")
    ax.set_ylabel("SLO attainment (turns)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    attainment = out / "sweep_attainment.png"
    fig.savefig(attainment, dpi=100)
    plt.close(fig)
    return [latency, attainment]
