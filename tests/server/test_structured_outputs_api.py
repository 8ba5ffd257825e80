"""Structured outputs through a real server on the tiny random checkpoint: OpenAI's
response_format, vLLM's structured_outputs and guided_* fields, on both routes, streaming and
not; every output validates. Specs that cannot compile, or two constraints at once, are 400s
naming the field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_harness import chat_server

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
USER = [{"role": "user", "content": "Is it? Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = chat_server(tiny_checkpoint, tmp_path_factory)
    yield proc
    proc.stop()


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    return http.post(path, json={"model": "tiny", "max_tokens": 200, **body})


def texts(http: httpx.Client, path: str, body: dict) -> list[str]:
    response = post(http, path, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def streamed_texts(http: httpx.Client, path: str, body: dict) -> dict[int, str]:
    parts: dict[int, str] = {}
    with http.stream("POST", path, json={"model": "tiny", "max_tokens": 200, "stream": True,
                                         **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    piece = c.get("text", c.get("delta", {}).get("content")) or ""
                    parts[c["index"]] = parts.get(c["index"], "") + piece
    return parts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_response_format_json_schema_validates_on_both_routes(http, seed):
    body = {"response_format": RESPONSE_FORMAT, "temperature": 1.0, "seed": seed, "n": 2}
    outputs = (texts(http, "/v1/completions", {"prompt": "Answer:", **body})
               + texts(http, "/v1/chat/completions", {"messages": USER, **body}))
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_structured_outputs_validate(http):
    body = {"structured_outputs": {"json": SCHEMA}, "temperature": 1.0, "seed": 4, "n": 3}
    for text in streamed_texts(http, "/v1/completions", {"prompt": "x", **body}).values():
        jsonschema.validate(json.loads(text), SCHEMA)
    body = {"guided_choice": ["left", "right"], "temperature": 1.0, "seed": 5}
    [text] = streamed_texts(http, "/v1/chat/completions", {"messages": USER, **body}).values()
    assert text in ("left", "right")


def test_official_client_with_extra_body_and_response_format(client):
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=200,
                                           temperature=0, response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    reply = client.completions.create(model="tiny", prompt="Colour:", max_tokens=20,
                                      extra_body={"guided_regex": r"#[0-9a-f]{6}"})
    assert re.fullmatch(r"#[0-9a-f]{6}", reply.choices[0].text)


def test_guided_fields_and_json_object(http):
    [text] = texts(http, "/v1/completions", {"prompt": "x", "guided_grammar":
                                              'root ::= "a" [0-9] | "b"'})
    assert re.fullmatch(r"a[0-9]|b", text)
    [text] = texts(http, "/v1/completions", {"prompt": "x", "guided_json": SCHEMA,
                                              "guided_decoding_backend": "xgrammar"})
    jsonschema.validate(json.loads(text), SCHEMA)
    [text] = texts(http, "/v1/chat/completions", {"messages": USER, "temperature": 0,
                                                   "response_format": {"type": "json_object"}})
    assert text.startswith("{")


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_json": {"type": "objectx"}}, "guided_json", "objectx"),
    ({"structured_outputs": {"grammar": "root ::= nothere"}}, "structured_outputs", "nothere"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "xgrammar"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "whitespace")])
def test_a_spec_the_server_cannot_honour_is_a_400_naming_the_field(http, body, param, words):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                              {"messages": USER})):
        response = post(http, path, {**base, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_a_bad_spec_stalls_nobody(http):
    """A spec that fails its check never reaches the engine: the server keeps answering."""
    assert post(http, "/v1/completions", {"prompt": "x", "guided_regex": "("}).status_code == 400
    assert texts(http, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert http.get("/health").status_code == 200
