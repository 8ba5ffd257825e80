"""The PNGs of a scripts/bench_spec.py result: single-stream speedup against the acceptance
rate beside the analytic expectation, forced and with the switch-off (spec_rates.png), and throughput against batch size
(spec_batches.png). `bench_spec.py --replot spec.json` draws them again."""
from __future__ import annotations

from pathlib import Path


def replot(result: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (spec.json has the numbers; --replot later)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["single_stream"]
    for k in sorted({r["k"] for r in rows}):
        mine = [r for r in rows if r["k"] == k]
        line, = ax.plot([r["a"] for r in mine], [r["speedup"] for r in mine], marker="o",
                        label=f"k={k} measured")
        ax.plot([r["a"] for r in mine], [r["expected"] for r in mine], linestyle="--",
                color=line.get_color(), label=f"k={k} analytic")
        if all("speedup_switch_on" in r for r in mine):
            ax.plot([r["a"] for r in mine], [r["speedup_switch_on"] for r in mine],
                    marker="x", linestyle=":", color=line.get_color(),
                    label=f"k={k} with the switch-off")
    ax.set(xlabel="acceptance rate a", ylabel="single-stream speedup",
           title=f"{result['args']['model']}: oracle proposer")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "spec_rates.png", dpi=120)
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = result["batches"]
    for key in ("speedup_switch_off", "speedup_switch_on"):
        if any(key in r for r in rows):
            ax.plot([r["batch"] for r in rows], [r.get(key) for r in rows], marker="o",
                    label=key.replace("speedup_", "").replace("_", " "))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="batch size", ylabel="throughput vs no speculation", xscale="log",
           title=f"a = {result['args']['batch_rate']}, k = {result['args']['batch_k']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "spec_batches.png", dpi=120)
    print(f"wrote {out / 'spec_rates.png'} and {out / 'spec_batches.png'}")
