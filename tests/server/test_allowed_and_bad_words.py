"""allowed_token_ids and bad_words through a real server on the tiny checkpoint, on both
routes; and the chat route taking every completion field vLLM's chat takes (priority,
truncate_prompt_tokens, return_token_ids, return_tokens_as_token_ids, continuous usage)."""
from __future__ import annotations

import json

import httpx
import pytest
from server_harness import CHAT_TEMPLATE, chat_server

from engine.output.tokenizer import Tokenizer

ALLOWED = [21555, 21557, 21558]
PROMPT = "The quick brown fox jumps over the lazy dog"
USER = [{"role": "user", "content": PROMPT}]
TOKENIZER = Tokenizer()
WORDS = [TOKENIZER.encode(" " + word)[0] for word in ("hello", "world", "cat", "dog")]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = chat_server(tiny_checkpoint, tmp_path_factory)
    yield proc
    proc.stop()


def post(http: httpx.Client, path: str, **body) -> dict:
    response = http.post(path, json={"model": "tiny", "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def complete(http: httpx.Client, **body) -> dict:
    return post(http, "/v1/completions", prompt=PROMPT, return_token_ids=True, **body)


def chat(http: httpx.Client, **body) -> dict:
    return post(http, "/v1/chat/completions", messages=USER, **body)


def refused(http: httpx.Client, path: str, body: dict, param: str) -> dict:
    response = http.post(path, json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def stream(http: httpx.Client, **body) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": USER, "ignore_eos": True, "stream": True,
            **body}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_allowed_token_ids_only_ever_yield_those_tokens(http):
    free = complete(http, max_tokens=48, n=4, temperature=1.0, seed=1)
    assert any(set(c["token_ids"]) - set(ALLOWED) for c in free["choices"])  # guards below
    body = complete(http, max_tokens=48, n=4, temperature=1.0, seed=1,
                    allowed_token_ids=ALLOWED)
    tokens = [t for choice in body["choices"] for t in choice["token_ids"]]
    assert len(tokens) == 4 * 48 and set(tokens) <= set(ALLOWED)
    assert len(set(tokens)) > 1  # sampled among them, not stuck on one


def test_bad_words_ban_what_greedy_produced(http):
    """Among WORDS (each one token, banned as it is and after a space), greedy's favourite
    is banned everywhere once named; the others stay."""
    greedy = complete(http, max_tokens=16, temperature=0,
                      allowed_token_ids=WORDS)["choices"][0]["token_ids"]
    favourite = greedy[0]
    banned = complete(http, max_tokens=16, temperature=0, allowed_token_ids=WORDS,
                      bad_words=[TOKENIZER.decode([favourite])])["choices"][0]["token_ids"]
    assert favourite not in banned and set(banned) <= set(WORDS)


def test_a_two_token_bad_word_bans_its_second_token_after_its_first(http):
    greedy = complete(http, max_tokens=16, temperature=0,
                      allowed_token_ids=WORDS)["choices"][0]["token_ids"]
    word = TOKENIZER.decode(greedy[:2])
    assert greedy[:2] in TOKENIZER.bad_words_token_ids([word])
    banned = complete(http, max_tokens=16, temperature=0, allowed_token_ids=WORDS,
                      bad_words=[word])["choices"][0]["token_ids"]
    assert banned[0] == greedy[0]  # alone, the first token is not banned
    assert banned[1] != greedy[1]
    for sequence in TOKENIZER.bad_words_token_ids([word]):
        assert not contains(banned, sequence)


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": PROMPT}),
                                        ("/v1/chat/completions", {"messages": USER})])
def test_bad_values_are_400s_naming_the_field(http, path, base):
    refused(http, path, {**base, "allowed_token_ids": []}, "allowed_token_ids")
    refused(http, path, {**base, "allowed_token_ids": [50257]}, "allowed_token_ids")
    refused(http, path, {**base, "allowed_token_ids": ["a"]}, "allowed_token_ids")
    refused(http, path, {**base, "bad_words": [""]}, "bad_words")
    refused(http, path, {**base, "bad_words": ["ok", "  "]}, "bad_words")
    refused(http, path, {**base, "bad_words": "word"}, "bad_words")


def test_chat_takes_allowed_token_ids_and_bad_words(http):
    body = chat(http, max_tokens=32, n=2, temperature=1.0, seed=3,
                allowed_token_ids=ALLOWED, return_token_ids=True)
    tokens = [t for choice in body["choices"] for t in choice["token_ids"]]
    assert len(tokens) == 64 and set(tokens) <= set(ALLOWED)
    greedy = chat(http, max_tokens=16, temperature=0, return_token_ids=True,
                  allowed_token_ids=WORDS)["choices"][0]["token_ids"]
    banned = chat(http, max_tokens=16, temperature=0, return_token_ids=True,
                  allowed_token_ids=WORDS, bad_words=[TOKENIZER.decode(greedy[:1])])
    assert greedy[0] not in banned["choices"][0]["token_ids"]


def test_chat_return_token_ids_and_tokens_as_token_ids(http):
    body = chat(http, max_tokens=6, temperature=0, return_token_ids=True, logprobs=True,
                top_logprobs=2, return_tokens_as_token_ids=True)
    prompt = TOKENIZER.encoding.encode(CHAT_TEMPLATE.replace(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        f"user: {PROMPT}\n"), allowed_special="all")
    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == len(prompt)
    choice = body["choices"][0]
    assert TOKENIZER.decode(choice["token_ids"]) == choice["message"]["content"]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(top["token"].startswith("token_id:") for e in content
               for top in e["top_logprobs"])
    plain = chat(http, max_tokens=6, temperature=0)
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_chat_truncate_prompt_tokens_keeps_the_last_tokens(http):
    full = chat(http, max_tokens=4, temperature=0, return_token_ids=True)
    kept = chat(http, max_tokens=4, temperature=0, return_token_ids=True,
                truncate_prompt_tokens=5)
    assert kept["prompt_token_ids"] == full["prompt_token_ids"][-5:]
    assert kept["usage"]["prompt_tokens"] == 5


def test_chat_best_of_is_checked_as_on_completions(http):
    assert len(chat(http, max_tokens=2, n=2, best_of=2)["choices"]) == 2
    refused(http, "/v1/chat/completions", {"messages": USER, "best_of": 3}, "best_of")


def test_chat_priority_follows_the_scheduling_policy(http):
    assert chat(http, max_tokens=2, priority=0)["choices"]
    error = refused(http, "/v1/chat/completions", {"messages": USER, "priority": 3},
                    "priority")
    assert "--scheduling-policy priority" in error["message"]


def test_chat_streams_continuous_usage_and_token_ids(http):
    chunks = stream(http, max_tokens=5, temperature=0, return_token_ids=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    opening, *deltas, last = chunks
    assert opening["choices"][0]["delta"]["role"] == "assistant"
    prompt_tokens = len(opening["prompt_token_ids"])
    assert opening["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                "total_tokens": prompt_tokens}
    streamed = [t for chunk in deltas for t in chunk["choices"][0]["token_ids"]]
    assert len(streamed) == 5
    counts = [chunk["usage"]["completion_tokens"] for chunk in deltas]
    assert counts == sorted(counts) and counts[-1] == 5
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
