"""scripts/bench_spec.py end to end at toy sizes on CPU: every sweep runs, speculation leaves
every greedy output unchanged (the runs record where it would not), and lands in spec.json."""
import json
import subprocess
import sys

import pytest

from server_harness import ROOT


def bench_spec(argv: list[str]) -> None:
    """`python scripts/bench_spec.py ARGV`, as the GPU node runs it."""
    subprocess.run([sys.executable, "scripts/bench_spec.py", *argv], cwd=ROOT, check=True,
                   timeout=600)


@pytest.mark.slow
def test_bench_spec_writes_every_sweep(tiny_checkpoint, tmp_path):
    bench_spec(["--model", str(tiny_checkpoint), "--device", "cpu", "--out", str(tmp_path),
          "--rates", "0,1", "--ks", "2", "--batches", "1,2", "--batch-k", "2",
          "--batch-repeats", "2", "--stream-repeats", "2", "--prompt-len", "16",
          "--output-len", "6"])
    result = json.loads((tmp_path / "spec.json").read_text())
    assert [(r["k"], r["a"]) for r in result["single_stream"]] == [(2, 0.0), (2, 1.0)]
    full, none = result["single_stream"][1], result["single_stream"][0]
    # 6 tokens: the prefill's, then rows of 2 and 1 drafts (max_tokens cuts the last short)
    assert full["a_measured"] == 1.0 and full["mean_accepted_length"] == 2.5
    assert none["a_measured"] == 0.0
    assert [r["batch"] for r in result["batches"]] == [1, 2]
    assert all(r["speedup_switch_off"] > 0 for r in result["batches"])
    # each batch size's speedup: the median of its two rounds (no cost model on CPU: forced)
    assert all(len(r["speedups_switch_off"]) == 2 and "speedups_switch_on" not in r
               for r in result["batches"])
    # a single-stream point: the median of its two rounds, forced (no switched runs on CPU)
    assert all(len(r["speedups"]) == 2 and "speedup_switch_on" not in r
               for r in result["single_stream"])
    assert full["a_rounds"] == [1.0, 1.0] and none["a_rounds"] == [0.0, 0.0]
    assert result["ngram"]["k"] == 2 and result["ngram"]["speedup_mean"] > 0
    assert set(result["pipelining"]) == {"async_ms_per_token", "sync_ms_per_token"}
    # speculation left every greedy output as plain decoding had it
    assert all(r["diverged_at"] is None for r in result["single_stream"])
    assert result["ngram"]["diverged_at"] == [None] * 4


def test_bench_spec_measures_a_draft_model(tiny_checkpoint, tmp_path):
    """The target drafting for itself: every greedy draft is accepted; with the oracle's
    tokens swapped in at a = 0, none is (the swap, not the draft, sets the acceptance)."""
    bench_spec(["--model", str(tiny_checkpoint), "--draft-model", str(tiny_checkpoint),
          "--device", "cpu", "--out", str(tmp_path), "--ks", "1,2", "--rates", "0",
          "--batches", "1", "--batch-k", "2", "--prompt-len", "16", "--output-len", "6"])
    result = json.loads((tmp_path / "spec_draft.json").read_text())
    rows = result["single_stream"]
    assert [(r["k"], r["a"]) for r in rows] == [(1, None), (1, 0.0), (2, None), (2, 0.0)]
    assert all(r["speedup"] > 0 and len(r["speedups"]) == 3 for r in rows)
    assert result["plain_ms_per_token"] > 0
    assert [r["a_measured"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert all(r["diverged_at"] is None for r in rows)
