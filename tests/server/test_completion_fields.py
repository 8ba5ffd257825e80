"""vLLM's completion fields beyond OpenAI's: truncate_prompt_tokens, continuous usage stats,
return_token_ids, return_tokens_as_token_ids, max_tokens 0 with echo, and any number of stop
strings (matched at a per-token cost that does not grow with their count). Served by a real
server on the tiny checkpoint, with a 64-token context so that truncation is cheap to reach."""
from __future__ import annotations

import json
import random
import re
import time

import httpx
import pytest

from engine.output.detokenize import TextStream
from engine.output.tokenizer import Tokenizer
from server_harness import ServerProcess

MAX_MODEL_LEN = 64
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "128",
                         "--max-model-len", str(MAX_MODEL_LEN))
    yield proc
    proc.stop()



@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "tiny", "temperature": 0,
                                                  "ignore_eos": True, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(http: httpx.Client, **body) -> list[dict]:
    """The stream's JSON chunks; asserts it ends with [DONE]."""
    with http.stream("POST", "/v1/completions", json={
            "model": "tiny", "temperature": 0, "ignore_eos": True, "stream": True,
            **body}) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def refused(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    return response.json()["error"]


# ---- truncate_prompt_tokens ---------------------------------------------------------------

def test_truncation_keeps_the_last_tokens_and_the_model_sees_only_them(http, tok):
    ids = tok.encode(PROMPT)
    whole = complete(http, prompt=ids, max_tokens=6, truncate_prompt_tokens=3, echo=True,
                     return_token_ids=True)
    alone = complete(http, prompt=ids[-3:], max_tokens=6)
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == ids[-3:] and whole["usage"]["prompt_tokens"] == 3
    assert choice["text"] == tok.decode(ids[-3:]) + alone["choices"][0]["text"]


def test_minus_one_keeps_what_fits_beside_max_tokens(http):
    long_prompt = list(range(1000, 1000 + 3 * MAX_MODEL_LEN))
    too_long = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 5})
    assert too_long.status_code == 400
    done = complete(http, prompt=long_prompt, max_tokens=5, truncate_prompt_tokens=-1)
    assert done["usage"] == {"prompt_tokens": MAX_MODEL_LEN - 5, "completion_tokens": 5,
                             "total_tokens": MAX_MODEL_LEN}


def test_truncation_beyond_the_context_is_a_400_naming_it(http):
    error = refused(http, prompt="hi", truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    assert error["param"] == "truncate_prompt_tokens" and str(MAX_MODEL_LEN) in error["message"]


# ---- stream_options.continuous_usage_stats --------------------------------------------------

@pytest.mark.parametrize("include_usage", [False, True])
def test_continuous_usage_is_in_every_chunk_per_choice(http, tok, include_usage):
    chunks = stream_chunks(http, prompt=[PROMPT, "Hello"], n=2, temperature=1.0, seed=3,
                           max_tokens=5, stream_options={"continuous_usage_stats": True,
                                                         "include_usage": include_usage})
    prompt_len = {0: len(tok.encode(PROMPT)), 2: len(tok.encode("Hello"))}
    with_choices = [c for c in chunks if c["choices"]]
    counts: dict[int, list[int]] = {}
    for chunk in with_choices:
        index, usage = chunk["choices"][0]["index"], chunk["usage"]
        assert usage["prompt_tokens"] == prompt_len[index - index % 2]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts.setdefault(index, []).append(usage["completion_tokens"])
    assert set(counts) == {0, 1, 2, 3}
    assert all(seen == sorted(seen) and seen[-1] == 5 for seen in counts.values())
    last = chunks[-1]
    assert (last["choices"] == [] and last["usage"]["completion_tokens"] == 20) == include_usage


# ---- return_token_ids and return_tokens_as_token_ids --------------------------------------

def test_return_token_ids_whole_and_streamed(http, tok):
    body = dict(prompt=PROMPT, max_tokens=8, return_token_ids=True)
    choice = complete(http, **body)["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(PROMPT)
    assert len(choice["token_ids"]) == 8 and tok.decode(choice["token_ids"]) == choice["text"]
    chunks = [c["choices"][0] for c in stream_chunks(http, **body)]
    assert chunks[0]["prompt_token_ids"] == tok.encode(PROMPT)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    plain = complete(http, prompt=PROMPT, max_tokens=2)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_tokens_as_token_ids(http, tok, stream):
    body = dict(prompt=PROMPT, max_tokens=6, logprobs=2, return_tokens_as_token_ids=True,
                return_token_ids=True)
    choices = ([c["choices"][0] for c in stream_chunks(http, **body)] if stream
               else complete(http, **body)["choices"])
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert tokens == [f"token_id:{t}" for c in choices for t in c["token_ids"]]
    for top in (t for c in choices for t in c["logprobs"]["top_logprobs"]):
        assert all(re.fullmatch(r"token_id:\d+", name) for name in top)
    text = "".join(c["text"] for c in choices)
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    ids = [t for c in choices for t in c["token_ids"]]
    assert offsets == [len(tok.decode(ids[:i])) for i in range(len(ids))]  # into the text
    assert len(text) == len(tok.decode(ids))


# ---- max_tokens 0 with echo ------------------------------------------------------------------

def test_max_tokens_zero_with_echo_returns_the_prompt_alone(http, tok):
    ids = tok.encode(PROMPT)
    whole = complete(http, prompt=[PROMPT, ids[:3]], max_tokens=0, echo=True, n=2,
                     temperature=0.5, return_token_ids=True)
    assert [c["text"] for c in whole["choices"]] == [PROMPT] * 2 + [tok.decode(ids[:3])] * 2
    assert all(c["finish_reason"] == "length" and c["token_ids"] == []
               for c in whole["choices"])
    assert whole["usage"] == {"prompt_tokens": len(ids) + 3, "completion_tokens": 0,
                              "total_tokens": len(ids) + 3}  # a prompt counts once, as in vLLM
    chunks = stream_chunks(http, prompt=PROMPT, max_tokens=0, echo=True,
                           stream_options={"include_usage": True})
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"])
            for c in chunks[:-1]] == [(PROMPT, "length")]
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def test_max_tokens_zero_needs_echo_and_a_prompt_within_the_context(http):
    assert refused(http, prompt="hi", max_tokens=0)["param"] == "max_tokens"
    error = refused(http, prompt=list(range(MAX_MODEL_LEN + 1)), max_tokens=0, echo=True)
    assert error["code"] == "context_length_exceeded"


# ---- stop strings: any number, matched cheaply -----------------------------------------------

DECOYS = [f"<decoy {i}>" for i in range(999)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_thousand_stop_strings(http, stream):
    text = complete(http, prompt=PROMPT, max_tokens=16)["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and not any(d in text for d in DECOYS)
    body = dict(prompt=PROMPT, max_tokens=16, stop=DECOYS[:500] + [stop] + DECOYS[500:])
    if stream:
        chunks = [c["choices"][0] for c in stream_chunks(http, **body)]
        got, last = "".join(c["text"] for c in chunks), chunks[-1]
    else:
        last = complete(http, **body)["choices"][0]
        got = last["text"]
    assert got == text[:text.index(stop)]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


def reference_stop(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    """The text up to the first stop string to appear, token by token (of several
    appearing with one token, the one that starts first)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits)
            return text[:index], stop
    return text, None


@pytest.mark.parametrize("seed", range(20))
def test_stop_matching_agrees_with_a_plain_search(tok, seed):
    rng = random.Random(seed)
    ids = tok.encode("the cat sat on the mat and then the dog ran after the cat " * 3)
    text = tok.decode(ids)
    stops = sorted({text[i:i + rng.randint(1, 6)]
                    for i in (rng.randrange(len(text)) for _ in range(rng.randint(1, 8)))
                    } - {""}) + ["never there"]
    stream = TextStream(tok, tuple(stops))
    emitted = "".join(stream.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids))
    pieces = [tok.decode([t]) for t in ids]
    assert (emitted, stream.stopped_by) == reference_stop(stops, pieces)


def test_a_stop_string_that_ended_within_min_tokens_never_counts(tok):
    """As in vLLM: a stop string is looked for where a token's text ends it, and only once
    more than min_tokens tokens are out; "##" ends with token k, inside the first k."""
    ids = tok.encode("a## b c d e f")
    k = next(i for i in range(1, len(ids) + 1) if "##" in tok.decode(ids[:i]))
    stream = TextStream(tok, ("##", "a much longer one"), min_tokens=k)
    emitted = "".join(stream.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert stream.stopped_by is None and emitted == "a## b c d e f"


def seconds_per_token(tok: Tokenizer, stops: tuple[str, ...], ids: list[int]) -> float:
    best = float("inf")
    for _ in range(5):
        stream = TextStream(tok, stops)
        start = time.perf_counter()
        for i, token in enumerate(ids):
            stream.add(token, final=i == len(ids) - 1)
        best = min(best, time.perf_counter() - start)
        assert stream.stopped_by is None
    return best / len(ids)


def test_stop_matching_cost_per_token_hardly_grows_with_the_count(tok):
    """A thousand stop strings cost about what one does (a search per stop string per
    token costs 15 to 20 times more)."""
    rng = random.Random(0)
    ids = [rng.randrange(50000) for _ in range(2000)]
    words = [f"{tok.decode([rng.randrange(50000)])}~{i}" for i in range(1000)]
    one = seconds_per_token(tok, (words[0],), ids)
    thousand = seconds_per_token(tok, tuple(words), ids)
    assert thousand < 4 * one, (one, thousand)
