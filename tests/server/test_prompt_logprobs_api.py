"""Prompt logprobs over HTTP, against transformers' log_softmax of the served checkpoint:
vLLM's `prompt_logprobs` field (completions: per choice; chat: top level), OpenAI's `echo`
with `logprobs` (the echoed prompt's tokens carry their logprobs), `max_tokens` 0 with echo
and logprobs (the prompt scored, nothing generated), and lm-evaluation-harness's
loglikelihood requests parsed as the harness parses them. The server's token budget (16) is
smaller than the prompts, so their logprobs arrive over several prefill chunks."""
from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from engine.output.tokenizer import Tokenizer
from server_harness import chat_server

TOLERANCE = 1e-4
TOKENIZER = Tokenizer()


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = chat_server(tiny_checkpoint, tmp_path_factory, "--max-num-batched-tokens", "16")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


def hf_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """Row p: log_softmax of the logits after tokens[:p + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50256) for _ in range(n)]


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def name(token_id: int) -> str:
    return TOKENIZER.decode([token_id])


def test_prompt_logprobs_field_is_vllms_at_every_position(http, hf_model):
    prompt = random_prompt(40, 1)
    reference = hf_logprobs(hf_model, prompt)
    body = complete(http, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=2)
    [choice] = body["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    for index, entry in enumerate(entries[1:], start=1):
        row, token = reference[index - 1], prompt[index]
        own = entry[str(token)]  # JSON keys: the token ids as strings
        assert set(own) == {"logprob", "rank", "decoded_token"}
        assert abs(own["logprob"] - row[token].item()) < TOLERANCE
        assert own["decoded_token"] == name(token) and own["rank"] >= 1
        top = sorted((lp["rank"], int(t)) for t, lp in entry.items() if lp["rank"] <= 2)
        assert [rank for rank, _ in top] == [1, 2]
        assert [t for _, t in top] == row.topk(2).indices.tolist()
    assert choice["logprobs"] is None and body["usage"]["completion_tokens"] == 2
    plain = complete(http, prompt=prompt, max_tokens=2, temperature=0)["choices"][0]
    assert "prompt_logprobs" not in plain and plain["text"] == choice["text"]


def test_prompt_logprobs_do_not_stream_but_zero_may(http):
    response = http.post("/v1/completions", json={"prompt": "Hi", "stream": True,
                                                  "prompt_logprobs": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
    with http.stream("POST", "/v1/completions", json={
            "prompt": "Hi", "stream": True, "prompt_logprobs": 0, "max_tokens": 2}) as reply:
        assert reply.status_code == 200
        assert [line for line in reply.iter_lines() if line][-1] == "data: [DONE]"


def check_echoed_logprobs(logprobs: dict, prompt: list[int], reference: torch.Tensor,
                          k: int) -> None:
    """The echoed prompt's part of OpenAI's logprobs: its tokens, null for the first, then
    each token's logprob and a top dict of the top-k plus the token, offsets from 0."""
    n = len(prompt)
    assert logprobs["tokens"][:n] == [name(t) for t in prompt]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offsets = [0]
    for t in prompt[:-1]:
        offsets.append(offsets[-1] + len(name(t)))
    assert logprobs["text_offset"][:n] == offsets
    for index in range(1, n):
        row, token = reference[index - 1], prompt[index]
        assert abs(logprobs["token_logprobs"][index] - row[token].item()) < TOLERANCE
        top = logprobs["top_logprobs"][index]
        assert name(token) in top and len(top) <= k + 1
        assert max(top.values()) == pytest.approx(row.max().item(), abs=TOLERANCE)


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(http, hf_model):
    text = "The quick brown fox jumps over the lazy dog, and then it runs far away"
    prompt = TOKENIZER.encode(text)
    reference = hf_logprobs(hf_model, prompt)
    body = complete(http, prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0)
    alone = complete(http, prompt=text, logprobs=2, max_tokens=3, temperature=0)
    [choice], [generated] = body["choices"], alone["choices"]
    assert choice["text"] == text + generated["text"]
    logprobs, n = choice["logprobs"], len(prompt)
    check_echoed_logprobs(logprobs, prompt, reference, k=2)
    for field in ("tokens", "token_logprobs", "top_logprobs"):
        assert logprobs[field][n:] == generated["logprobs"][field]
    assert logprobs["text_offset"][n:] == [len(text) + o
                                           for o in generated["logprobs"]["text_offset"]]
    assert len(choice["prompt_logprobs"]) == n  # vLLM returns what the engine computed
    stream = stream_choices(http, prompt=text, echo=True, logprobs=2, max_tokens=3,
                            temperature=0)
    assert "".join(c["text"] for c in stream) == choice["text"]
    assert [t for c in stream for t in c["logprobs"]["tokens"]] == logprobs["tokens"]
    assert [t for c in stream for t in c["logprobs"]["token_logprobs"]] == \
        logprobs["token_logprobs"]


def stream_choices(http: httpx.Client, **body) -> list[dict]:
    with http.stream("POST", "/v1/completions",
                     json={"model": "tiny", "stream": True, **body}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [choice for event in events[:-1] for choice in json.loads(event)["choices"]]


def test_max_tokens_zero_with_echo_and_logprobs_scores_the_prompt_alone(http, hf_model):
    prompt = random_prompt(37, 2)
    reference = hf_logprobs(hf_model, prompt)
    body = complete(http, prompt=prompt, echo=True, logprobs=3, max_tokens=0,
                    return_token_ids=True)
    [choice] = body["choices"]
    assert choice["text"] == TOKENIZER.decode(prompt) and choice["finish_reason"] == "length"
    assert choice["token_ids"] == [] and body["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    check_echoed_logprobs(choice["logprobs"], prompt, reference, k=3)
    [streamed] = stream_choices(http, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    assert streamed["text"] == choice["text"] and streamed["finish_reason"] == "length"
    assert streamed["logprobs"] == choice["logprobs"]


def greedy_continuation(hf_model, context: list[int], n: int) -> list[int]:
    tokens = list(context)
    for _ in range(n):
        tokens.append(int(hf_logprobs(hf_model, tokens)[-1].argmax()))
    return tokens[len(context):]


def hf_loglikelihood(hf_model, context: list[int], continuation: list[int]
                     ) -> tuple[float, bool]:
    rows = hf_logprobs(hf_model, context + continuation)[len(context) - 1:-1]
    logprob = sum(rows[i, t].item() for i, t in enumerate(continuation))
    return logprob, rows.argmax(-1).tolist() == continuation


@pytest.fixture(scope="module")
def loglikelihood_requests(hf_model) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs: a greedy continuation and a random one."""
    context = random_prompt(30, 3)
    return [(context, greedy_continuation(hf_model, context, 4)),
            (context, random_prompt(5, 4))]


def test_lm_eval_loglikelihood_request_with_max_tokens_zero(http, hf_model,
                                                            loglikelihood_requests):
    """The request lm-evaluation-harness's local-completions sent for loglikelihood (0.4.x:
    echo, max_tokens 0), parsed as its get_result does: the continuation's logprobs summed
    from token_logprobs[ctxlen:], greedy when at each of its positions the top_logprobs key
    with the largest value is the token itself."""
    for context, continuation in loglikelihood_requests:
        ctxlen = len(context)
        body = complete(http, prompt=context + continuation, echo=True, logprobs=1,
                        max_tokens=0, temperature=0)
        logprobs = body["choices"][0]["logprobs"]
        loglikelihood = sum(logprobs["token_logprobs"][ctxlen:])
        is_greedy = True
        for i in range(ctxlen, len(logprobs["token_logprobs"])):
            top_tokens = logprobs["top_logprobs"][i]
            top_token = max(top_tokens.keys(), key=lambda x: top_tokens[x])
            if top_token != logprobs["tokens"][i]:
                is_greedy = False
                break
        expected, expected_greedy = hf_loglikelihood(hf_model, context, continuation)
        assert loglikelihood == pytest.approx(expected, abs=len(continuation) * TOLERANCE)
        assert is_greedy == expected_greedy
        assert body["usage"]["completion_tokens"] == 0
    assert expected_greedy is False  # the random continuation


def test_lm_eval_loglikelihood_request_of_the_current_harness(http, hf_model,
                                                              loglikelihood_requests):
    """The current harness's payload (LocalCompletionsAPI._create_payload, generate=False:
    echo, max_tokens 1, logprobs 1, seed) parsed as its parse_logprobs does: the generated
    token is dropped with [ctxlen:-1], greedy when each token's logprob is the top one's."""
    ctxlens = [len(context) for context, _ in loglikelihood_requests]
    out = complete(http, prompt=[c + t for c, t in loglikelihood_requests], temperature=0,
                   max_tokens=1, logprobs=1, seed=1234, echo=True)
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    for (logprob, is_greedy), (context, continuation) in zip(res, loglikelihood_requests):
        expected, expected_greedy = hf_loglikelihood(hf_model, context, continuation)
        assert logprob == pytest.approx(expected, abs=len(continuation) * TOLERANCE)
        assert is_greedy == expected_greedy
    assert [r[1] for r in res] == [True, False]


def test_chat_returns_the_rendered_prompts_logprobs_at_the_top_level(http, hf_model):
    messages = [{"role": "user", "content": "Tell me about foxes and dogs, in detail"}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    reference = hf_logprobs(hf_model, tokens)
    response = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_completion_tokens": 2,
        "prompt_logprobs": 1})
    assert response.status_code == 200, response.text
    entries = response.json()["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    for index, entry in enumerate(entries[1:], start=1):
        own = entry[str(tokens[index])]
        assert abs(own["logprob"] - reference[index - 1, tokens[index]].item()) < TOLERANCE
    plain = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_completion_tokens": 2}).json()
    assert "prompt_logprobs" not in plain
    streamed = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"
