"""scripts/soak.py, briefly, on CPU: it starts the server, mixes good, disconnecting and bad
requests, and reports zero fatal errors, a drained server, memory samples and a PNG."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_harness import ROOT


@pytest.mark.slow
def test_a_short_soak_is_clean_and_reports_everything(tiny_checkpoint, tmp_path):
    server_args = "--device cpu --dtype float32 --attention-backend torch --num-kv-blocks 256"
    run = subprocess.run(
        [sys.executable, "scripts/soak.py", "--minutes", "0.2", "--model", str(tiny_checkpoint),
         "--server-args", server_args, "--concurrency", "8", "--max-prompt-len", "32",
         "--max-tokens", "8", "--out", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},  # as conftest's servers
        check=False, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((tmp_path / "soak.json").read_text())
    outcomes = summary["outcomes"]
    assert summary["served"] > 0 and outcomes["disconnected"] > 0 and outcomes["rejected"] > 0
    assert summary["fatal"] == 0 and summary["drained"]
    assert {"stream", "complete", "disconnect"} <= set(summary["kinds"])
    assert summary["kv_cache_usage_max"] > 0 and summary["rss_mib"]["max"] > 0
    assert all(w["p99_e2e_s"] is not None for w in summary["windows"] if w["ok"])
    assert summary["shutdown"]["seconds_to_exit"] < 30
    assert (tmp_path / "soak.png").read_bytes().startswith(b"\x89PNG")
