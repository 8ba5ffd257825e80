"""Priority scheduling and the engine-step metrics through a real server (one subprocess
serving the tiny checkpoint one sequence at a time under the priority policy), and the
`priority` field's parsing under each policy."""
from __future__ import annotations

import threading
from contextlib import ExitStack

import httpx
import pytest

from server.protocol import Limits, RequestError, parse_completion_request
from server_harness import ServerProcess, metric, wait_for

NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--scheduling-policy", "priority",
                         "--max-num-seqs", "1", "--num-kv-blocks", str(NUM_KV_BLOCKS))
    yield proc
    proc.stop()


def test_priority_needs_the_priority_policy():
    fcfs, priority = Limits(50257, 1024), Limits(50257, 1024, priority_scheduling=True)
    for value in (0, None):
        assert parse_completion_request({"prompt": "x", "priority": value}, fcfs)
    with pytest.raises(RequestError) as info:
        parse_completion_request({"prompt": "x", "priority": -3}, fcfs)
    assert info.value.param == "priority" and "--scheduling-policy priority" in str(info.value)
    assert parse_completion_request({"prompt": "x", "priority": -3}, priority).priority == -3
    with pytest.raises(RequestError) as info:
        parse_completion_request({"prompt": "x", "priority": 1.5}, priority)
    assert info.value.param == "priority"


def waiting(server) -> float:
    return metric(server.url, "vllm:num_requests_waiting", model_name="tiny")


def test_a_later_urgent_request_runs_before_earlier_ones(server):
    """One sequence runs at a time. While hogs (the most urgent, streamed) hold the engine,
    `relaxed` (priority 5) and then `urgent` (priority -5) queue behind them; when the hogs'
    clients hang up, urgent runs first."""
    finished: list[str] = []

    def complete(name: str, priority: int) -> None:
        answer = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": name, "max_tokens": 8, "ignore_eos": True, "priority": priority})
        assert answer.status_code == 200, answer.text
        finished.append(name)

    num_hogs, threads = 3, []  # each lasts ~1 s on an idle 2-core machine
    with httpx.Client(base_url=server.url, timeout=120) as http, ExitStack() as hogs:
        for i in range(num_hogs):
            hog = hogs.enter_context(http.stream("POST", "/v1/completions", json={
                "prompt": f"hog {i}", "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "priority": -100}))
            assert hog.status_code == 200
        for name, priority in (("relaxed", 5), ("urgent", -5)):
            threads.append(threading.Thread(target=complete, args=(name, priority)))
            threads[-1].start()
            queued = num_hogs - 1 + len(threads)
            assert wait_for(lambda n=queued: waiting(server) == n, timeout=30)
    for thread in threads:  # leaving the hogs' streams hung up on them: they are aborted
        thread.join(timeout=120)
    assert finished == ["urgent", "relaxed"]


def histogram(server, name: str) -> dict[str, float]:
    """Count, sum and the bucket counts (by `le`) of a histogram family."""
    values = {"count": metric(server.url, name + "_count", model_name="tiny"),
              "sum": metric(server.url, name + "_sum", model_name="tiny")}
    for le in ("1.0", "8.0", "16.0"):
        values[le] = metric(server.url, name + "_bucket", model_name="tiny", le=le)
    return values


def test_iteration_tokens_count_each_scheduled_step(server):
    """A 4-token prompt and 5 output tokens, alone in the engine: a prefill step of 4 tokens
    (sampling the first), then one 1-token step per further output token."""
    assert wait_for(lambda: waiting(server) == 0, timeout=30)
    before = histogram(server, "vllm:iteration_tokens_total")
    answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": [464, 2068, 7586, 21831], "max_tokens": 5, "ignore_eos": True})
    assert answer.json()["usage"]["completion_tokens"] == 5
    after = histogram(server, "vllm:iteration_tokens_total")
    assert {key: after[key] - before[key] for key in after} == {
        "count": 5, "sum": 4 + 4 * 1, "1.0": 4, "8.0": 5, "16.0": 5}


def test_cache_config_info_labels_the_cache_settings(server):
    assert metric(server.url, "vllm:cache_config_info", block_size="16",
                  num_gpu_blocks=str(NUM_KV_BLOCKS),
                  num_gpu_blocks_override=str(NUM_KV_BLOCKS), enable_prefix_caching="True",
                  gpu_memory_utilization="0.9", cache_dtype="auto", engine="0") == 1.0
