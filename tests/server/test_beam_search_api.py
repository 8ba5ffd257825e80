"""use_beam_search on /v1/completions and /v1/chat/completions, end to end: a `python -m
server` subprocess serving a peaky tiny checkpoint (tests/peaky_checkpoint.py), whose
answers must be the offline LLM.beam_search's on the same weights; and the 400s for what
beam search does not take."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import torch

from engine import LLM
from engine.beam_search import BeamSearchParams
from peaky_checkpoint import make_peaky_checkpoint
from server_harness import ServerProcess, metric, wait_for

MAX_MODEL_LEN = 64
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_peaky_checkpoint(tmp_path_factory.mktemp("peaky-gpt2"))


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    proc = ServerProcess(checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "256",
                         "--max-model-len", str(MAX_MODEL_LEN), "--num-cpu-threads", "1",
                         "--chat-template", TEMPLATE)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """The offline engine on the same weights, one torch thread as the server's core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=256,
              attention_backend="torch", max_model_len=MAX_MODEL_LEN)
    torch.set_num_threads(threads)


def expected_choices(offline, prompt, **params):
    """(text, finish_reason, token count) of each beam the offline API returns, best first."""
    [output] = offline.beam_search([prompt], BeamSearchParams(**params))
    decode = offline.engine.tokenizer.decode
    return [(decode(seq.text_token_ids(with_prompt=False)), seq.finish_reason,
             len(seq.output_token_ids)) for seq in output.sequences]


def completion(http, **body):
    response = http.post("/v1/completions", json={"model": "tiny", "use_beam_search": True,
                                                  **body})
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("extra", [
    {}, {"length_penalty": 0.0}, {"length_penalty": 2.0, "early_stopping": "never"},
    {"early_stopping": True, "temperature": 0.0}, {"ignore_eos": True},
    {"include_stop_str_in_output": True}])
def test_completion_returns_the_n_best_beams_of_the_offline_search(http, offline, extra):
    prompt = [464, 3797, 3332, 319]
    body = completion(http, prompt=prompt, n=3, max_tokens=10, **extra)
    beam_fields = {k: v for k, v in extra.items() if k != "temperature"}
    want = expected_choices(offline, prompt, beam_width=3, max_tokens=10, **beam_fields)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(text, reason) for text, reason, _ in want]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": sum(n for *_, n in want),
                             "total_tokens": 4 + sum(n for *_, n in want)}


def test_every_prompt_gets_its_own_n_beams_and_eos_is_their_stop_reason(http, offline):
    prompts = ["The cat", "A dog"]
    body = completion(http, prompt=prompts, n=2, max_tokens=6, temperature=0.0,
                      return_token_ids=True)
    tokenizer = offline.engine.tokenizer
    for i, prompt in enumerate(prompts):
        choices = body["choices"][2 * i:2 * i + 2]
        assert [c["index"] for c in choices] == [2 * i, 2 * i + 1]
        want = expected_choices(offline, tokenizer.encode(prompt), beam_width=2, max_tokens=6)
        assert [(c["text"], c["finish_reason"]) for c in choices] == \
            [(text, reason) for text, reason, _ in want]
        for choice in choices:
            assert choice["stop_reason"] == (50256 if choice["finish_reason"] == "stop" else None)
            assert choice["prompt_token_ids"] == tokenizer.encode(prompt)


def test_a_stream_sends_each_beam_whole_then_usage_and_done(http):
    body = {"model": "tiny", "prompt": "The cat", "n": 3, "max_tokens": 8,
            "use_beam_search": True, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    beams = [chunk["choices"][0] for chunk in chunks[:-1]]
    whole = completion(http, prompt="The cat", n=3, max_tokens=8)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in beams] == \
        [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_chat_returns_n_beams_streaming_and_not(http, offline):
    body = {"model": "tiny", "messages": USER, "n": 2, "max_completion_tokens": 7,
            "use_beam_search": True, "length_penalty": 0.5}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    chat = response.json()
    prompt = offline.engine.tokenizer.encode("user: Hello there\nassistant:")
    want = expected_choices(offline, prompt, beam_width=2, max_tokens=7, length_penalty=0.5)
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in chat["choices"]] == [(i, text, reason)
                                          for i, (text, reason, _) in enumerate(want)]
    assert chat["usage"]["completion_tokens"] == sum(n for *_, n in want)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        events = sse_events(streamed)
    assert events[-1] == "[DONE]"
    deltas = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [d["delta"].get("role") for d in deltas[:2]] == ["assistant", "assistant"]
    assert [(d["index"], d["delta"]["content"], d["finish_reason"]) for d in deltas[2:]] == \
        [(c["index"], c["message"]["content"], c["finish_reason"]) for c in chat["choices"]]


def test_max_tokens_null_searches_to_the_end_of_the_context(http):
    body = completion(http, prompt=[464] * 60, n=2, max_tokens=None, ignore_eos=True)
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * (MAX_MODEL_LEN - 60)


def refused(http, body, param, path="/v1/completions"):
    response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize("field,value", [
    ("logprobs", 1), ("prompt_logprobs", 0), ("stop", ["x"]), ("stop_token_ids", [11]),
    ("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("seed", 1),
    ("logit_bias", {"11": 1.0}), ("min_tokens", 2), ("allowed_token_ids", [11]),
    ("bad_words", ["cat"]), ("response_format", {"type": "json_object"}),
    ("structured_outputs", {"regex": "[a-z]+"}), ("guided_choice", ["yes", "no"])])
def test_a_field_beam_search_does_not_take_is_a_400_naming_it(http, field, value):
    error = refused(http, {"prompt": "x", "use_beam_search": True, "n": 2, field: value}, field)
    assert "use_beam_search" in error["message"]


def test_beam_search_refusals_name_the_field(http):
    refused(http, {"prompt": "x", "use_beam_search": True, "n": 11}, "n")
    refused(http, {"prompt": "x", "use_beam_search": True, "early_stopping": "sometimes"},
            "early_stopping")
    refused(http, {"prompt": "x", "length_penalty": 0.5}, "length_penalty")
    refused(http, {"prompt": "x", "early_stopping": True}, "early_stopping")
    error = refused(http, {"prompt": [464] * 60, "use_beam_search": True, "max_tokens": 5},
                    "max_tokens")
    assert error["code"] == "context_length_exceeded"
    chat = {"messages": USER, "use_beam_search": True, "n": 2}
    refused(http, {**chat, "logprobs": True}, "logprobs", "/v1/chat/completions")
    refused(http, {**chat, "logprobs": True, "top_logprobs": 2}, "top_logprobs",
            "/v1/chat/completions")
    refused(http, {**chat, "stop": ["x"]}, "stop", "/v1/chat/completions")


def test_a_search_the_core_would_never_admit_is_a_400(checkpoint, tmp_path):
    """8 blocks of 16 tokens, 3 sequences a step. 4 beams x 50 tokens can never be held;
    nor can 4 x 23 past a 10-token prompt, though its 102 tokens fit: each beam's own
    blocks round up (3 each, 12 in all). 4 beams never run at once; 2 x 20 fit exactly."""
    proc = ServerProcess(checkpoint, tmp_path / "server.log", "--num-kv-blocks", "8",
                         "--max-num-seqs", "3", "--max-model-len", str(MAX_MODEL_LEN),
                         "--num-cpu-threads", "1")
    try:
        def search(n: int, max_tokens: int) -> httpx.Response:
            return httpx.post(proc.url + "/v1/completions", timeout=60, json={
                "prompt": [464] * 10, "use_beam_search": True, "n": n,
                "max_tokens": max_tokens, "ignore_eos": True})

        for n, max_tokens, message in ((4, 50, "KV cache holds 8 blocks (128 tokens)"),
                                       (4, 23, "may hold 12 KV blocks")):
            response = search(n, max_tokens)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
            assert message in error["message"]
        response = search(4, 20)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "n"
        assert "at most 3 sequences" in response.json()["error"]["message"]
        response = search(2, 20)
        assert response.status_code == 200, response.text
        assert [len(c["text"]) > 0 for c in response.json()["choices"]] == [True, True]
    finally:
        proc.stop()


def test_n_beams_at_temperature_zero_and_neutral_values_pass(http):
    body = completion(http, prompt="x", n=4, temperature=0.0, max_tokens=3, top_p=1.0,
                      top_k=-1, stop=[], logit_bias={}, early_stopping=False)
    assert len(body["choices"]) == 4
    plain = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                "use_beam_search": False,
                                                "length_penalty": 1.0, "early_stopping": False})
    assert plain.status_code == 200, plain.text


def test_a_client_that_goes_away_ends_the_search(server):
    """A raw socket, closed while the search runs in the engine (about a second of steps): the
    search is aborted there, its blocks freed, and no result is reported."""
    def gauges_are_zero() -> bool:
        return (metric(server.url, "vllm:num_requests_running") == 0
                and metric(server.url, "vllm:kv_cache_usage_perc") == 0)

    body = json.dumps({"model": "tiny", "prompt": "x", "use_beam_search": True, "n": 10,
                       "max_tokens": MAX_MODEL_LEN - 1, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    before = metric(server.url, "vllm:generation_tokens_total")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request.encode())
        assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") > 0)
    assert wait_for(gauges_are_zero)
    time.sleep(0.5)
    assert gauges_are_zero()
    assert metric(server.url, "vllm:generation_tokens_total") == before
