"""A KV pool far smaller than the work: requests are preempted (recomputed) many times, and
every output still equals the request's solo run."""
from __future__ import annotations

import random

from server_harness import metric, wait_for
from sse_client import run_streams, solo_texts


def test_preempted_requests_give_identical_outputs(launch):
    """3 blocks of 16 tokens hold 48 tokens; 8 requests of 4 + 20 tokens need 192. Each
    prompt fits one block, so three are admitted at once and preempt each other as they grow."""
    server = launch("--num-kv-blocks", "3", "--max-num-seqs", "8")
    rng = random.Random(3)
    bodies = [{"prompt": [rng.randrange(50000) for _ in range(4)], "max_tokens": 20,
               "temperature": 0, "ignore_eos": True} for _ in range(8)]
    solo = solo_texts(server.url, bodies)
    assert metric(server.url, "vllm:num_preemptions_total") == 0  # one request fits alone
    streams = run_streams(server.url, bodies)
    assert all(s.status == 200 and s.done and s.finish_reason == "length" for s in streams)
    assert [s.text for s in streams] == solo
    assert metric(server.url, "vllm:num_preemptions_total") >= 5  # 14 seen
    assert wait_for(lambda: metric(server.url, "vllm:kv_cache_usage_perc") == 0)
