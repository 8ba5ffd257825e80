"""PNG plots of a run (latency CDFs) and of a rate sweep (latency and throughput against
offered load). matplotlib comes with the `bench` extra; the Agg backend needs no display."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from server.bench.metrics import RequestResult


def require_matplotlib() -> None:
    """Fail before the load runs, not after."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'gpt2-serve[bench]'") from None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_s: list[float], label: str) -> None:
    """The empirical CDF: a step up of 1/n at each sample."""
    ms = np.sort(np.array(values_s)) * 1000.0
    ax.step(ms, np.arange(1, len(ms) + 1) / max(len(ms), 1), where="post", label=label)


def _plain_numbers(axis) -> None:
    """Log-scale ticks as 600, not 6x10^2 (minor ones labelled only on a short range)."""
    from matplotlib.ticker import LogFormatter

    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def plot_cdfs(results: list[RequestResult], path: str | Path, title: str) -> None:
    """TTFT (one point per request) and ITL (one per gap between chunks) CDFs side by side."""
    plt = _pyplot()
    done = [r for r in results if r.ok]
    fig, (ttft_ax, itl_ax) = plt.subplots(1, 2, figsize=(10, 4))
    _cdf(ttft_ax, [r.ttft for r in done], f"{len(done)} requests")
    _cdf(itl_ax, [gap for r in done for gap in r.itl], "all gaps")
    for ax, name in ((ttft_ax, "TTFT (ms)"), (itl_ax, "ITL (ms)")):
        ax.set(xlabel=name, ylabel="fraction of samples", xscale="log", ylim=(0, 1.01))
        _plain_numbers(ax.xaxis)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rate_labels: list[str], summaries: list[dict], path: str | Path,
               title: str) -> None:
    """p50/p99 TTFT, p50/p99 ITL and output tok/s, one point per offered rate."""
    plt = _pyplot()
    xs = range(len(rate_labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name in ((axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "ITL (ms)")):
        for stat in ("median", "p99"):
            ax.plot(xs, [s[f"{stat}_{key}_ms"] for s in summaries], marker="o",
                    label="p50" if stat == "median" else "p99")
        ax.set(ylabel=name, yscale="log")
        _plain_numbers(ax.yaxis)
    axes[2].plot(xs, [s["output_throughput"] for s in summaries], marker="o",
                 label="served")
    axes[2].set(ylabel="output tokens/s", ylim=(0, None))
    for ax in axes:
        ax.set(xlabel="offered load (requests/s)")
        ax.set_xticks(list(xs), rate_labels)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
