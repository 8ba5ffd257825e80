"""The server with `--speculative-config`: a completion on a prompt that repeats itself is
verified in speculative steps, and /metrics and the periodic log line say so."""
from __future__ import annotations

import httpx

from server_harness import ServerProcess, metric, wait_for

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'


def test_metrics_export_the_spec_decode_counters(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--num-kv-blocks", "64",
                           "--speculative-config", SPEC)
    try:
        prompt = list(range(100, 110)) * 4  # restated: the n-gram lookup finds matches
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": str(tiny_checkpoint.name), "prompt": prompt, "max_tokens": 24,
            "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        name = "vllm:spec_decode_"
        accepted = metric(server.url, name + "num_accepted_tokens_total")
        draft_tokens = metric(server.url, name + "num_draft_tokens_total")
        assert 0 < accepted <= draft_tokens <= 3 * metric(server.url, name + "num_drafts_total")
        first = metric(server.url, name + "num_accepted_tokens_per_pos_total", position="0")
        assert 0 < first <= accepted
        assert metric(server.url, "gpt2serve:spec_decode_draft_length") == 3  # no switch-off
        assert wait_for(lambda: "spec acceptance rate" in server.log(), timeout=5)
        assert "speculation: every step drafts 3 tokens (no switch-off off CUDA)" in server.log()
    finally:
        server.stop()
