"""Admission under overload: a bounded queue answers 503 (never another error), recovers once
the burst passes, holds memory flat over many bursts, and counts a request as the P x n
sequences it costs, so no single request slips past the cap."""
from __future__ import annotations

import asyncio
import random
import subprocess

import httpx
import pytest
from server_harness import metric, wait_for
from sse_client import client

QUEUE_CAP = 4


@pytest.fixture(scope="module")
def server(launch):
    return launch("--max-num-seqs", "2", "--max-queued-requests", str(QUEUE_CAP),
                  "--num-kv-blocks", "1024")


def burst(url: str, count: int, seed: int) -> list[httpx.Response]:
    rng = random.Random(seed)
    bodies = [{"prompt": [rng.randrange(50000) for _ in range(rng.randint(1, 30))],
               "max_tokens": rng.randint(2, 6), "ignore_eos": True} for _ in range(count)]

    async def main() -> list[httpx.Response]:
        async with client(url) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=b)
                                          for b in bodies))
    return asyncio.run(main())


def idle(url: str) -> bool:
    return (metric(url, "vllm:num_requests_running") == 0
            and metric(url, "vllm:num_requests_waiting") == 0
            and metric(url, "vllm:kv_cache_usage_perc") == 0)


def test_overload_gets_503s_then_recovers_with_flat_memory(server):
    rss = []
    for round_ in range(8):
        responses = burst(server.url, 40, seed=round_)
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(503) > 0 and statuses.count(200) >= QUEUE_CAP
        assert all(r.headers["retry-after"] for r in responses if r.status_code == 503)
        assert wait_for(lambda: idle(server.url), timeout=30)
        recovered = httpx.post(server.url + "/v1/completions",
                               json={"prompt": "after the burst", "max_tokens": 2})
        assert recovered.status_code == 200
        rss.append(server_rss_mib(server.proc.pid))
    assert max(rss[3:]) - rss[2] < 16, rss  # MiB; warmed up by round 3, flat after that


def server_rss_mib(pid: int) -> float:
    """The resident memory of the server and its children (the engine core), from ps."""
    listed = subprocess.run(["ps", "-o", "rss=", "-p", str(pid), "--ppid", str(pid)],
                            capture_output=True, text=True, check=True).stdout
    return sum(int(kib) for kib in listed.split()) / 1024


def completion(url: str, prompts: list, n: int = 1) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"prompt": prompts, "n": n, "max_tokens": 1})


def test_one_request_with_more_prompts_than_the_queue_cap_is_refused(server):
    assert completion(server.url, [[7]] * QUEUE_CAP).status_code == 200
    refused = completion(server.url, [[7]] * (QUEUE_CAP + 1))
    assert refused.status_code in (400, 503), refused.text
    assert idle(server.url)


def test_prompts_times_n_count_against_the_queue_cap(server):
    assert completion(server.url, [[7], [8]], n=2).status_code == 200
    refused = completion(server.url, [[7], [8]], n=3)
    assert refused.status_code in (400, 503), refused.text
    assert idle(server.url)
