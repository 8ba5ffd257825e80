"""Shared pieces of the benchmark scripts: device ceilings, checkpoints, result files, plots."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.worker.models.random_checkpoint import ARCHS, make_checkpoint
from kernels.timing import cuda_ms

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "docs" / "benchmarks"


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(n_bytes // 2, device="cuda", dtype=torch.float16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = cuda_ms(functools.partial(dst.copy_, src), repeats) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n_bytes / seconds


def matmul_rate(n: int = 8192, repeats: int = 10) -> float:
    """fp16 matmul FLOP/s on random n x n operands (long enough that event timing needs no
    graph: launch overhead is negligible next to ~1 ms of work)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    return 2 * n ** 3 / (cuda_ms(lambda: a @ b, repeats) / 1e3)


def device_info() -> dict:
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    return {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bandwidth(),
            "torch": torch.__version__}


class _ProbeRow:
    __slots__ = ("key", "value", "next")

    def __init__(self, key: str, value: int, next_value: int) -> None:
        self.key, self.value, self.next = key, value, next_value


def _probe_work(n: int = 1000) -> int:
    table = {f"r{i}": i for i in range(n)}
    rows = [_ProbeRow(key, value, value + 1) for key, value in table.items()]
    return sum(table[row.key] + row.next for row in rows)


def host_probe_us(rounds: int = 7) -> float:
    """Median microseconds of a fixed pure-Python workload (a dict, small objects, a loop: what
    a step's bookkeeping does) on the CPU this process runs on now. A host-bound ratio moves
    with it (docs/performance.md, "The node's host"), so the benchmarks record it beside each
    timed pair."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        _probe_work()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[rounds // 2]


def checkpoint_for(model: str) -> str:
    """A named arch without a local copy becomes a random checkpoint under checkpoints/."""
    if model in ARCHS:
        out = ROOT / "checkpoints" / f"{model}-random"
        if not (out / "config.json").exists():
            print(f"writing random-weight {model} checkpoint to {out}", flush=True)
            make_checkpoint(out, arch=model, dtype="float16")
        return str(out)
    return model


def model_bytes(checkpoint: str, bytes_per_param: int = 2) -> tuple[int, dict]:
    """Weight bytes at the serving dtype, and the config (layers, width) for KV sizing."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    d, layers, vocab, pos = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"], cfg["n_positions"]
    params = vocab * d + pos * d + layers * (12 * d * d + 13 * d) + 2 * d
    return params * bytes_per_param, cfg


def write_result(name: str, result: dict, out_dir: Path = BENCH_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "git": _git_rev(), **result}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}", flush=True)
    return path


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=False).stdout.strip()
    except OSError:
        return "unknown"


def plot(path: Path, xs: list, series: dict[str, list], xlabel: str, ylabel: str,
         title: str) -> None:
    """A PNG line plot; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)
