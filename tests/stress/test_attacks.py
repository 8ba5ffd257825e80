"""The attacks of issue 12 as regressions, then SIGTERM under load (last: it ends the server).

The freeze: a client sends one completion with 10,000 prompts and hangs up; aborting them
must not stall the engine for anyone else. The per-request prompt cap refuses more."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from server_harness import metric, wait_for
from sse_client import Stream, client, sigterm, until

MANY = 10_000
SHUTDOWN_TIMEOUT = 3


@pytest.fixture(scope="module")
def server(launch):
    return launch("--max-prompts-per-request", str(MANY), "--max-queued-requests", str(MANY),
                  "--max-num-seqs", "32", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                  "--num-kv-blocks", "1024")


def test_a_huge_request_whose_client_hangs_up_does_not_stall_others(server):
    async def scenario() -> float:
        async with client(server.url) as http:
            huge = Stream({"prompt": [[i % 50000, 1] for i in range(MANY)], "max_tokens": 16},
                          hang_up_after=1)
            await huge.run(http)  # admitted (first tokens came), then the client is gone
            assert huge.status == 200 and huge.hung_up
            start = time.monotonic()
            victim = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert victim.status_code == 200
            return time.monotonic() - start
    assert asyncio.run(scenario()) < 5.0
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_waiting") == 0
                    and metric(server.url, "vllm:kv_cache_usage_perc") == 0, timeout=10)


def test_more_prompts_than_the_per_request_cap_is_a_400(server):
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"prompt": [[1]] * (MANY + 1), "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert metric(server.url, "vllm:num_requests_waiting") == 0


def test_sigterm_under_load_ends_every_stream_within_the_timeout(server):
    """40 streams that need minutes are cut at the timeout: each gets an error event and
    [DONE], and the process is gone within the timeout plus 2 s."""
    async def scenario():
        async with client(server.url) as http:
            streams = [Stream({"prompt": [i, 2, 3], "max_tokens": 1000, "ignore_eos": True})
                       for i in range(40)]
            tasks = [asyncio.create_task(s.run(http)) for s in streams]
            assert await until(lambda: sum(bool(s.events) for s in streams) >= 32, timeout=60)
            return await sigterm(server, tasks, limit=SHUTDOWN_TIMEOUT + 2), streams
    seconds_to_exit, streams = asyncio.run(scenario())
    assert seconds_to_exit <= SHUTDOWN_TIMEOUT + 2
    assert all(s.done and s.error is not None and s.failure is None for s in streams)
    assert "Traceback" not in server.log()
