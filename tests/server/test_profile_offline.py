"""scripts/profile_offline.py end to end at toy sizes on CPU: every computed token lands in
one step kind, and both kinds ran (prompt chunks beside decodes, then decodes alone)."""
import json
import subprocess
import sys

from server_harness import ROOT


def test_every_token_is_counted_in_one_step_kind_and_top_kernels_listed(tiny_checkpoint):
    prompts, input_len, output_len = 12, 40, 6
    proc = subprocess.run(
        [sys.executable, "scripts/profile_offline.py", "--model", str(tiny_checkpoint),
         "--device", "cpu", "--num-prompts", str(prompts), "--input-len", str(input_len),
         "--output-len", str(output_len), "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--kernels", "3"],
        cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    kinds = result["kinds"]
    assert set(kinds) == {"decode", "mixed"}
    # each prompt's tokens, and each output token but the last fed back in
    assert sum(k["tokens"] for k in kinds.values()) == prompts * (input_len + output_len - 1)
    assert all(k["launch_ms"] > 0 and k["device_ms"] is None for k in kinds.values())
    assert result["device_busy"] is None
    top = result["kernels"]
    assert len(top) == 3 and top[0]["ms"] >= top[1]["ms"] >= top[2]["ms"] > 0
    assert 0 < sum(k["share"] for k in top) <= 1
