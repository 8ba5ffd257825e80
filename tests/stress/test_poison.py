"""Poison requests: input that once failed after the request was counted (an int msgpack
cannot encode, a lone surrogate, bytes that are not UTF-8) gets a 400 and leaves nothing
behind. The proof of "nothing": a request costing the whole queue cap is still admitted, and
/health stays 200 through an idle watchdog period (an orphan once kept the core "busy" and
the watchdog fired on it). Then a fuzz of thousands of hostile bodies, with the same check."""
from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from server_harness import metric, wait_for
from sse_client import client

QUEUE_CAP = 4
WATCHDOG = 2
HUGE = 10**30
POISON = [  # (raw body, what it attacks)
    json.dumps({"prompt": "hi", "top_k": HUGE}), json.dumps({"prompt": "hi", "top_k": 2**64}),
    json.dumps({"prompt": "hi", "max_tokens": HUGE}),
    json.dumps({"prompt": "hi", "seed": -HUGE}),
    json.dumps({"prompt": "hi", "min_tokens": HUGE}),
    json.dumps({"prompt": "hi", "stop": "\ud800"}),
    json.dumps({"prompt": "hi", "stop": ["ok", "x\udfffy"], "n": 4, "temperature": 1}),
    json.dumps({"prompt": "\ud83d", "max_tokens": 1}),
    json.dumps({"prompt": "hi", "user": "\udc00"}),
    json.dumps({"prompt": "hi", "\ud800": 1}),
    json.dumps({"prompt": "hi", "stop_token_ids": [HUGE]}),
    json.dumps({"prompt": "hi", "logit_bias": {str(HUGE): 1}}),
    json.dumps({"prompt": [[1, HUGE]]}),
    json.dumps({"prompt": "hi", "n": HUGE}),
    json.dumps({"prompt": "hi", "best_of": HUGE}),
]
INVALID_UTF8 = [b'{"prompt": "hi\xff\xfe", "max_tokens": 1}', b'{"prompt": "\xed\xa0\x80"}',
                b'{"prompt": "hi", "stop": "\xc3"}']


@pytest.fixture(scope="module")
def server(launch):
    return launch("--max-queued-requests", str(QUEUE_CAP), "--watchdog-timeout",
                  str(WATCHDOG), "--max-num-seqs", "4", "--num-kv-blocks", "256")


def post(url: str, raw: bytes | str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=raw, timeout=30,
                      headers={"content-type": "application/json"})


def at_baseline(url: str) -> bool:
    """Nothing counted, nothing running: a request costing the whole cap is admitted."""
    full = httpx.post(url + "/v1/completions", timeout=30, json={
        "prompt": "after", "n": QUEUE_CAP, "temperature": 1, "max_tokens": 2})
    return (full.status_code == 200 and httpx.get(url + "/health").status_code == 200
            and metric(url, "vllm:num_requests_running") == 0
            and metric(url, "vllm:num_requests_waiting") == 0)


def test_each_poison_request_is_a_400_naming_its_field_and_leaves_nothing_behind(server):
    for raw in POISON * QUEUE_CAP:  # each leaked sequence once would fill the queue
        response = post(server.url, raw)
        assert response.status_code == 400, (raw, response.text)
        assert response.json()["error"]["message"], raw
    for raw in INVALID_UTF8:
        response = post(server.url, raw)
        assert response.status_code == 400, (raw, response.text)
        assert "UTF-8" in response.json()["error"]["message"]
    assert post(server.url, POISON[5]).json()["error"]["param"] == "stop"
    time.sleep(WATCHDOG + 1)  # idle past the watchdog: an orphan would turn /health 503
    assert at_baseline(server.url)
    assert "Traceback" not in server.log()


def hostile_bodies(count: int, seed: int) -> list[bytes]:
    """Valid bodies with one or two fields made hostile: wrong types, huge and negative
    numbers, NaN, surrogates, deep nesting, broken bytes, truncation."""
    rng = random.Random(seed)
    fields = ["prompt", "max_tokens", "n", "top_k", "top_p", "temperature", "seed", "stop",
              "logprobs", "logit_bias", "stop_token_ids", "min_tokens", "best_of", "echo",
              "stream", "stream_options", "user", "model", "presence_penalty", "min_p",
              "repetition_penalty", "cache_salt", "suffix", "ignore_eos"]
    values = [HUGE, -HUGE, 2**63, -1, 0, 1.5, -0.0, 1e308, "NaN", "\ud800", "", "x" * 5000,
              None, True, [], {}, [HUGE], [[[[[]]]]], {"\udfff": 1}, [1, "a"], "Infinity",
              {"a": {"b": [HUGE]}}, [50256, -5], "<|endoftext|>", 2**31]
    bodies = []
    for _ in range(count):
        body: dict = {"prompt": rng.choice(["hi", [1, 2], ["a", "b"]]), "max_tokens": 1}
        for name in rng.sample(fields, rng.randint(1, 2)):
            body[name] = rng.choice(values)
        raw = json.dumps(body).encode().replace(b'"NaN"', b"NaN").replace(
            b'"Infinity"', b"1e400")
        mutation = rng.random()
        if mutation < 0.05:
            raw = raw[:rng.randrange(len(raw))]
        elif mutation < 0.1:
            cut = rng.randrange(len(raw))
            raw = raw[:cut] + bytes([rng.randrange(128, 256)]) + raw[cut:]
        bodies.append(raw)
    return bodies


@pytest.mark.slow
def test_a_fuzz_of_hostile_bodies_never_gets_a_5xx_and_leaves_the_server_at_baseline(server):
    async def send_all(bodies: list[bytes]) -> list[int]:
        async with client(server.url, timeout=60) as http:
            gate = asyncio.Semaphore(32)

            async def one(raw: bytes) -> int:
                async with gate:
                    response = await http.post("/v1/completions", content=raw, headers={
                        "content-type": "application/json"})
                    return response.status_code
            return await asyncio.gather(*(one(raw) for raw in bodies))
    statuses = asyncio.run(send_all(hostile_bodies(3000, seed=0)))
    assert not [s for s in statuses if s >= 500 and s != 503], sorted(set(statuses))
    assert statuses.count(400) > 2000, sorted(set(statuses))  # most are refused outright
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0, timeout=30)
    assert at_baseline(server.url)
    assert "Traceback" not in server.log()
