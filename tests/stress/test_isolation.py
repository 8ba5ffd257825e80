"""Batching must be invisible: 200 concurrent greedy streams equal their solo runs, and a
storm of hang-ups leaves no request and no referenced KV block behind."""
from __future__ import annotations

import random

import pytest

from server_harness import metric, wait_for
from sse_client import run_streams, solo_texts

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(launch):
    return launch("--num-kv-blocks", "1024", "--max-num-seqs", "256")


def greedy_bodies(count: int, seed: int) -> list[dict]:
    """Prompts of 1 to 40 tokens, some sharing a 16-token prefix (a cached block)."""
    rng = random.Random(seed)
    shared = [rng.randrange(50000) for _ in range(16)]
    bodies = []
    for i in range(count):
        tail = [rng.randrange(50000) for _ in range(rng.randint(1, 24))]
        prompt = shared + tail if i % 3 == 0 else tail
        bodies.append({"prompt": prompt, "max_tokens": rng.randint(1, 4), **GREEDY})
    return bodies


def test_200_concurrent_greedy_streams_equal_their_solo_runs(server):
    distinct = greedy_bodies(50, seed=1)
    solo = solo_texts(server.url, distinct)
    streams = run_streams(server.url, [distinct[i % 50] for i in range(200)])
    assert all(s.status == 200 and s.done and s.error is None for s in streams), [
        vars(s) for s in streams if not s.done][:3]
    assert [s.text for s in streams] == [solo[i % 50] for i in range(200)]
    assert [s.finish_reason for s in streams] == ["length"] * 200


def test_disconnect_storm_leaves_no_requests_and_no_referenced_blocks(server):
    """Half the clients hang up after their first event, mid-generation; the rest finish."""
    bodies = [{**body, "max_tokens": 64 if i % 2 else 2}
              for i, body in enumerate(greedy_bodies(200, seed=2))]
    solo_texts(server.url, bodies[:1])  # caches the shared prefix block that a third reuse
    hits_before = metric(server.url, "vllm:prefix_cache_hits_total")
    streams = run_streams(server.url, bodies, hang_up_after=[1 if i % 2 else None
                                                              for i in range(200)])
    assert all(s.hung_up for s in streams[1::2]), [vars(s) for s in streams[1::2]
                                                   if not s.hung_up][:3]
    assert all(s.done and s.finish_reason == "length" for s in streams[::2]), [
        vars(s) for s in streams[::2] if not s.done][:3]
    # vllm:kv_cache_usage_perc counts blocks with references; cached free blocks count free
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0
                    and metric(server.url, "vllm:num_requests_waiting") == 0
                    and metric(server.url, "vllm:kv_cache_usage_perc") == 0, timeout=30)
    assert metric(server.url, "vllm:prefix_cache_hits_total") > hits_before  # cache in play
