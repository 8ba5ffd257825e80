"""The HTTP server end to end: a real uvicorn subprocess serving the tiny checkpoint, driven by
the official openai client (max_retries=0) and raw httpx. One server for the whole module."""
from __future__ import annotations

import json
import math
import socket

import httpx
import openai
import pytest

from server_harness import ServerProcess, metric, wait_for

PROMPT_FORMS = {
    "string": "The quick brown fox",
    "strings": ["The quick brown fox", "Hello"],
    "tokens": [464, 2068, 7586, 21831],
    "token_lists": [[464, 2068], [15496, 11, 995]],
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "256")
    yield proc
    proc.stop()




def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def stream_raw(http: httpx.Client, body: dict) -> list[str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def joined_stream_texts(events: list[str]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


@pytest.mark.parametrize("form", PROMPT_FORMS)
@pytest.mark.parametrize("n", [1, 2])
def test_every_prompt_form_streaming_and_not(client, http, form, n):
    prompt = PROMPT_FORMS[form]
    num_prompts = len(prompt) if form in ("strings", "token_lists") else 1
    body = dict(model="tiny", prompt=prompt, max_tokens=5, n=n, temperature=0.8, seed=1,
                ignore_eos=True)
    whole = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.model == "tiny"
    assert sorted(c.index for c in whole.choices) == list(range(num_prompts * n))
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage.completion_tokens == 5 * num_prompts * n
    events = stream_raw(http, body)
    assert events[-1] == "[DONE]"
    assert joined_stream_texts(events) == {c.index: c.text for c in whole.choices}


def test_finish_reason_only_on_the_last_chunk_of_each_choice(http):
    events = stream_raw(http, dict(prompt=["a b", "c d"], n=2, max_tokens=4, temperature=1.0,
                                   ignore_eos=True))
    chunks = [json.loads(e) for e in events[:-1]]
    seen_finish: set[int] = set()
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        assert choice["index"] not in seen_finish, "a chunk came after this choice finished"
        if choice["finish_reason"] is not None:
            seen_finish.add(choice["index"])
    assert seen_finish == {0, 1, 2, 3}


@pytest.mark.parametrize("options", [{"include_usage": True}, {}])  # vLLM's default: usage
def test_include_usage_chunk_comes_last_before_done(client, options):
    chunks = list(client.completions.create(model="tiny", prompt="Hi there", max_tokens=6,
                                            stream=True, temperature=0,
                                            stream_options=options,
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_finite_and_aligned(client, stream):
    response = client.completions.create(model="tiny", prompt="One two", max_tokens=5,
                                         logprobs=3, temperature=0, stream=stream,
                                         extra_body={"ignore_eos": True})
    choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
    tokens = [t for c in choices for t in c.logprobs.tokens]
    token_logprobs = [lp for c in choices for lp in c.logprobs.token_logprobs]
    top = [t for c in choices for t in c.logprobs.top_logprobs]
    offsets = [o for c in choices for o in c.logprobs.text_offset]
    assert len(tokens) == len(token_logprobs) == len(top) == len(offsets) == 5
    assert all(math.isfinite(lp) and lp <= 0 for lp in token_logprobs)
    assert all(1 <= len(entry) <= 4 for entry in top)
    assert offsets == sorted(offsets)
    for token, logprob, entry in zip(tokens, token_logprobs, top):
        assert entry.get(token, logprob) >= max(entry.values()) - 1e-5  # greedy: the best


@pytest.mark.parametrize("prompt", ["Echo me", [36, 6679, 502]])
def test_echo_prepends_the_prompt(client, http, prompt):
    text_prompt = http.post("/detokenize", json={"tokens": prompt}).json()["prompt"] \
        if isinstance(prompt, list) else prompt
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == text_prompt + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True))
    assert streamed == echoed.choices[0].text


def test_stop_string_is_not_returned(client):
    body = dict(model="tiny", prompt="Once upon", max_tokens=24, temperature=1.0, seed=5)
    full = client.completions.create(**body).choices[0].text
    start = next(i for i in range(3, len(full) - 3) if full.find(full[i:i + 3]) == i)
    stop = full[start:start + 3]
    cut = client.completions.create(**body, stop=[stop, "never-appears"]).choices[0]
    assert cut.text == full[:start] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(**body, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:start]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_streamed_text_equals_non_streamed_greedy(client):
    for prompt in ["The meaning of life is", "A", "x " * 60]:
        body = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        whole = client.completions.create(**body).choices[0]
        chunks = list(client.completions.create(**body, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason


LONG_PROMPT = [464] * 1000
BAD_REQUESTS = [  # (raw JSON body, the field the error must name)
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": [-1, 5]}', "prompt"),
    ('{"prompt": [50257]}', "prompt"),
    (json.dumps({"prompt": LONG_PROMPT, "max_tokens": 25}), "max_tokens"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 2.5}', "max_tokens"),
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('{"prompt": "x", "temperature": 1e999}', "temperature"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "top_p": 1.5}', "top_p"),
    ('{"prompt": "x", "top_k": -2}', "top_k"),
    ('{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
    ('{"prompt": "x", "frequency_penalty": -2.5}', "frequency_penalty"),
    ('{"prompt": "x", "n": 0}', "n"),
    ('{"prompt": "x", "n": 17}', "n"),
    ('{"prompt": "x", "n": 2, "temperature": 0}', "n"),
    ('{"prompt": "x", "logprobs": 21}', "logprobs"),
    ('{"prompt": "x", "stop": [""]}', "stop"),
    ('{"prompt": "x", "logit_bias": {"x1": 5}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"-3": 5}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"50257": 5}}', "logit_bias"),
    ('{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    ('{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}', None),
    ('[1, 2]', None),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS, ids=[b[:50] for b, _ in BAD_REQUESTS])
def test_bad_input_is_a_clear_400(http, body, param):
    response = http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if param:
        assert param in error["message"] or error["code"] == "context_length_exceeded"


def test_context_length_error_states_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=LONG_PROMPT, max_tokens=25)
    message = info.value.body["message"]
    assert "1024" in message and "1025" in message and "1000 in the prompt" in message


def test_oversized_body_and_logit_bias_clamp(http):
    huge = json.dumps({"prompt": "x" * (5 << 20)})
    response = http.post("/v1/completions", content=huge)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                            "logit_bias": {"13": 1e6}})
    assert ok.status_code == 200  # values clamp to ±100 instead of failing


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def wait_until_idle(server) -> bool:
    return wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0
                    and metric(server.url, "vllm:kv_cache_usage_perc") == 0)


def test_disconnect_mid_stream_frees_everything(server, http):
    body = {"prompt": "stream then vanish", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server.url, "vllm:num_requests_running") == 1
    assert wait_until_idle(server)


def test_disconnect_mid_non_stream_frees_everything(server):
    """A raw socket, so the disconnect happens exactly when the request is known running."""
    body = json.dumps({"prompt": "wait for me", "max_tokens": 1000, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request.encode())
        assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 1)
    assert wait_until_idle(server)


def test_metrics_move_as_requests_complete(server, client):
    def snapshot():
        return {name: metric(server.url, name) for name in (
            "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
            "vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
            "vllm:request_generation_tokens_sum", "vllm:prefix_cache_queries_total")} | {
            "success": metric(server.url, "vllm:request_success_total",
                              finished_reason="length")}
    before = snapshot()
    client.completions.create(model="tiny", prompt=[11] * 40, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    after = snapshot()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 7
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 40
    assert after["vllm:request_generation_tokens_sum"] \
        - before["vllm:request_generation_tokens_sum"] == 7
    assert after["success"] == before["success"] + 1
    for name in ("vllm:e2e_request_latency_seconds_count",
                 "vllm:time_to_first_token_seconds_count"):
        assert after[name] == before[name] + 1
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_side_endpoints(server, http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 1024
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {
        "prompt": "Hello world"}
    bad = http.post("/detokenize", json={"tokens": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.get("/nowhere").status_code == 404
    assert "Traceback" not in server.log()


def test_vllm_fields_that_work_request_id_empty_model_and_stop_reason(http):
    body = {"model": "", "prompt": [464, 2068], "max_tokens": 30, "temperature": 0,
            "request_id": "my-req-7", "stop_token_ids": [], "stop": None}
    whole = http.post("/v1/completions", json=body).json()
    assert whole["id"] == "cmpl-my-req-7" and whole["model"] == "tiny"
    text = whole["choices"][0]["text"]
    stop = text[3:6]  # a stop string inside the greedy text: it must end the choice there
    stopped = http.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    events = stream_raw(http, {**body, "stop": [stop]})
    last = json.loads(events[-2])["choices"][0]
    assert json.loads(events[0])["id"] == "cmpl-my-req-7"
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_a_vllm_field_that_is_not_implemented_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  extra_body={"logits_processors": ["my.Processor"]})
    assert info.value.body["param"] == "logits_processors"


def test_head_where_get_works_and_invocations(http):
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        assert http.head(path).status_code == 200, path
    answer = http.post("/invocations", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["object"] == "text_completion"
    chat = http.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400  # a chat request, and this server has no chat template
    assert "--chat-template" in chat.json()["error"]["message"]


def test_min_tokens_holds_back_stop_strings_and_the_stop_string_can_be_kept(http):
    body = {"prompt": [464, 2068], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    greedy = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first = http.post("/tokenize", json={"prompt": greedy}).json()["tokens"][0]
    stop = http.post("/detokenize", json={"tokens": [first]}).json()["prompt"]
    early = http.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert early["choices"][0]["text"] == "" and early["usage"]["completion_tokens"] == 1
    held = http.post("/v1/completions", json={**body, "stop": [stop], "min_tokens": 5}).json()
    assert held["usage"]["completion_tokens"] > 5  # vLLM: stop strings match after min_tokens
    cut = greedy[3:6]
    kept = http.post("/v1/completions", json={**body, "stop": [cut],
                                              "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == greedy[:greedy.index(cut) + len(cut)]


def test_max_tokens_null_is_the_rest_of_each_prompts_context(http):
    """vLLM's rule: a null max_tokens runs each prompt to max_model_len (1024 here)."""
    prompts = [[7] * 1000, [8] * 1010]
    answer = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": None,
                                                "ignore_eos": True, "min_tokens": 20})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 24 + 14
    assert all(c["finish_reason"] == "length" for c in answer.json()["choices"])
    omitted = http.post("/v1/completions", json={"prompt": [7], "ignore_eos": True}).json()
    assert omitted["usage"]["completion_tokens"] == 16  # left out: vLLM's default of 16
