"""Input validation and response helpers of the HTTP server, without a server or a model."""
from __future__ import annotations

import json
import math

import msgspec
import pytest

from engine.core.request import SamplingParams
from engine.output.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server.metrics import ServerMetrics, one_two_five_buckets
from server.protocol import (MAX_LOGGED_UNKNOWN, CompletionChoice, CompletionLogprobs,
                             CompletionResponse, Limits, RequestError, finite_logprob,
                             max_tokens_of, parse_completion_request, parse_prompt,
                             prompt_tokens_kept, to_sampling_params, truncate_prompts)
from server.completions import merge_deltas, sse_event

LIMITS = Limits(vocab_size=50257, max_model_len=1024, max_n=16)


def rejects(body: dict, param: str | None) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_completion_request(body, LIMITS)
    err = info.value
    assert err.status == 400 and err.param == param, (err.message, err.param)
    assert err.body()["error"]["message"] and err.body()["error"]["type"]
    return err


BAD_BODIES = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[5, True]]}, "prompt"),
    ({"prompt": [5, 1.0]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": math.nan}, "temperature"),
    ({"prompt": "x", "temperature": math.inf}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "presence_penalty": 2.01}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 2, "temperature": 0}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": ["a", ""]}, "stop"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"50257": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": math.nan}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": False, "stream_options": {}}, "stream_options"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop_token_ids": [50257]}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": 20}, "min_tokens"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 1025}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"prompt": "x", "truncate_prompt_tokens": 5.0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": "x", "return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[repr(b)[:60] for b, _ in BAD_BODIES])
def test_bad_body_names_the_field(body, param):
    err = rejects(body, param)
    assert param in err.message


def test_body_must_be_an_object():
    with pytest.raises(RequestError) as info:
        parse_completion_request([1, 2], LIMITS)
    assert info.value.code == "invalid_json"


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert parse_prompt(prompt, LIMITS) == expected


def test_prompt_count_is_capped_before_the_prompts_are_checked():
    limits = Limits(vocab_size=50257, max_model_len=1024, max_prompts=3)
    assert len(parse_prompt(["a"] * 3, limits)) == 3
    with pytest.raises(RequestError) as info:
        parse_prompt(["a", "b", "c", 7], limits)  # the bad 4th prompt is never looked at
    assert info.value.code == "too_many_prompts" and "at most 3 prompts" in info.value.message


def test_defaults_and_vllm_extras_reach_sampling_params():
    req = parse_completion_request({"prompt": "x"}, LIMITS)
    params = to_sampling_params(req, LIMITS.vocab_size)
    assert (params.max_tokens, params.temperature, params.n, params.top_k) == (16, 1.0, 1, -1)
    req = parse_completion_request({
        "prompt": "x", "max_tokens": 5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.2,
        "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7], "stop": "end",
        "seed": 3, "logit_bias": {"5": 500, "6": -1e9}, "n": 2, "temperature": 0.5}, LIMITS)
    params = to_sampling_params(req, LIMITS.vocab_size)
    assert params.top_k == 3 and params.ignore_eos and params.min_tokens == 2
    assert params.stop == ("end",) and params.stop_token_ids == (7,) and params.seed == 3
    assert dict(params.logit_bias) == {5: 100.0, 6: -100.0}  # clamped to ±100


def test_nulls_mean_defaults():
    """The openai client sends explicit nulls for parameters left unset."""
    body = {"prompt": "x", "max_tokens": None, "temperature": None, "n": None, "stop": None,
            "logprobs": None, "best_of": None, "suffix": None, "echo": None}
    req = parse_completion_request(body, LIMITS)
    params = to_sampling_params(req, LIMITS.vocab_size)
    assert params.n == 1 and params.logprobs is None and params.temperature == 1.0
    assert max_tokens_of(req) is None  # vLLM: null is the rest of each prompt's context
    assert max_tokens_of(parse_completion_request({"prompt": "x"}, LIMITS)) == 16


def test_finite_logprob():
    assert finite_logprob(-1.5) == -1.5
    assert finite_logprob(-math.inf) == -9999.0
    assert finite_logprob(math.nan) == -9999.0


def test_sse_event_format():
    assert sse_event({"a": 1, "b": math.nan}) == b'data: {"a":1,"b":null}\n\n'
    chunk = CompletionResponse(id="x", created=1, model="m", choices=[
        CompletionChoice(index=0, text="hi", logprobs=CompletionLogprobs(
            tokens=["hi"], token_logprobs=[-0.5], top_logprobs=[{"hi": -0.5}],
            text_offset=[0]))])
    assert json.loads(sse_event(chunk)[len(b"data: "):]) == {
        "id": "x", "object": "text_completion", "created": 1, "model": "m", "usage": None,
        "choices": [{"index": 0, "text": "hi", "finish_reason": None, "stop_reason": None,
                     "logprobs": {
            "tokens": ["hi"], "token_logprobs": [-0.5], "top_logprobs": [{"hi": -0.5}],
                         "text_offset": [0]}}]}


def test_one_two_five_buckets():
    assert one_two_five_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_metric_names_are_vllm_compatible():
    metrics = ServerMetrics("m", 1024)
    text = metrics.render().decode()
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert f'{name}' in text and 'model_name="m"' in text, name
    assert "vllm:request_success" in text


def sample(text: str, name: str, **labels: str) -> float:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    line = next(line for line in text.splitlines()
                if line.startswith(name + "{") and label_text in line)
    return float(line.rsplit(" ", 1)[1])


def test_request_phases_and_params_of_a_request_with_known_times():
    metrics = ServerMetrics("m", 1024)
    metrics.observe_request(SamplingParams(n=2, max_tokens=300))
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                            first_token_time=11.0, token_times=[11.0, 11.5, 13.0],
                            finish_time=13.0)
    done = CompletionOutput(0, "abc", [1, 2, 3], finish_reason="length")
    metrics.observe_output(RequestOutput("r", None, [7] * 4, [done], [timing]), first=True)
    text = metrics.render().decode()
    for name, seconds in (("queue_time", 0.5), ("prefill_time", 0.5), ("decode_time", 2.0),
                          ("inference_time", 2.5)):
        assert sample(text, f"vllm:request_{name}_seconds_sum") == seconds, name
        assert sample(text, f"vllm:request_{name}_seconds_count") == 1, name
    assert sample(text, "vllm:request_params_n_bucket", le="1.0") == 0
    assert sample(text, "vllm:request_params_n_bucket", le="2.0") == 1
    assert sample(text, "vllm:request_params_max_tokens_bucket", le="200.0") == 0
    assert sample(text, "vllm:request_params_max_tokens_bucket", le="500.0") == 1
    assert "process_cpu_seconds_total" in text and "python_info{" in text


def test_outputs_of_several_steps_merge_into_one_delta_per_choice():
    def output(choices):
        return RequestOutput("r", None, [1], choices, [])

    a1 = CompletionOutput(0, "He", [5], delta_text="He", delta_token_ids=[5])
    b1 = CompletionOutput(1, "X", [9], delta_text="X", delta_token_ids=[9])
    a2 = CompletionOutput(0, "Hello", [5, 6], delta_text="llo", delta_token_ids=[6],
                          finish_reason="length")
    merged = dict(((p, c.index), c) for p, c in merge_deltas(
        [(0, output([a1, b1])), (0, output([a2])), (1, output([a1]))]))
    assert set(merged) == {(0, 0), (0, 1), (1, 0)}
    assert (merged[0, 0].delta_text, merged[0, 0].delta_token_ids) == ("Hello", [5, 6])
    assert merged[0, 0].finish_reason == "length" and merged[0, 0].delta_logprobs is None
    assert merged[0, 1] is b1 and merged[1, 0] is a1


@pytest.mark.parametrize("field,value", [
    ("priority", 5), ("logits_processors", ["a.b"]),
    ("guided_whitespace_pattern", r"\s*"), ("skip_special_tokens", False)])
def test_a_vllm_field_asking_for_what_is_not_implemented_is_a_400_naming_it(field, value):
    err = rejects({"prompt": "x", field: value}, field)
    assert err.code == "unsupported_field" and field in err.message


@pytest.mark.parametrize("field,value", [
    ("use_beam_search", False), ("length_penalty", 1.0), ("prompt_logprobs", None),
    ("bad_words", []), ("include_stop_str_in_output", False), ("priority", 0),
    ("skip_special_tokens", True), ("spaces_between_special_tokens", True),
    ("add_special_tokens", False), ("request_id", "abc"), ("repetition_penalty", 5.0)])
def test_the_values_that_ask_for_nothing_pass(field, value):
    assert parse_completion_request({"prompt": "x", field: value}, LIMITS)


def test_the_vllm_extras_this_server_implements_parse():
    req = parse_completion_request({
        "prompt": "x", "stream": True, "truncate_prompt_tokens": 1024, "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream_options": {"continuous_usage_stats": True}}, LIMITS)
    assert req.continuous_usage and req.include_usage  # left out, include_usage is true
    assert req.return_token_ids and req.return_tokens_as_token_ids
    assert req.truncate_prompt_tokens == 1024


def test_max_tokens_zero_is_the_prompt_alone_with_echo_only():
    assert max_tokens_of(parse_completion_request(
        {"prompt": "x", "max_tokens": 0, "echo": True}, LIMITS)) == 0
    err = rejects({"prompt": "x", "max_tokens": 0}, "max_tokens")
    assert "echo" in err.message


def test_echo_with_logprobs_asks_the_engine_for_the_prompts_logprobs():
    """vLLM's rule: echo's logprobs cover the prompt (prompt_logprobs takes precedence), and
    max_tokens 0 then generates nothing in the engine; prompt_logprobs 0 may stream."""
    def params(**body):
        return to_sampling_params(parse_completion_request({"prompt": "x", **body}, LIMITS),
                                  LIMITS.vocab_size)

    assert params(echo=True, logprobs=2).prompt_logprobs == 2
    assert params(echo=True, logprobs=2, prompt_logprobs=5).prompt_logprobs == 5
    assert params(logprobs=2).prompt_logprobs is None
    assert params(echo=True, logprobs=1, max_tokens=0).max_tokens == 0
    assert params(prompt_logprobs=0, stream=True).prompt_logprobs == 0


def test_any_number_of_stop_strings_reach_the_engine():
    stops = [f"<{i}>" for i in range(1000)]
    req = parse_completion_request({"prompt": "x", "stop": stops}, LIMITS)
    assert to_sampling_params(req, LIMITS.vocab_size).stop == tuple(stops)


@pytest.mark.parametrize("body,kept", [
    ({}, None), ({"truncate_prompt_tokens": 7}, 7), ({"truncate_prompt_tokens": 1024}, 1024),
    ({"truncate_prompt_tokens": -1}, 1024 - 16),  # room for the default max_tokens
    ({"truncate_prompt_tokens": -1, "max_tokens": 100}, 1024 - 100),
    ({"truncate_prompt_tokens": -1, "max_tokens": None}, 1023),  # null: room for one token
    ({"truncate_prompt_tokens": -1, "max_tokens": 0, "echo": True}, 1024)])
def test_truncate_prompt_tokens_keeps_the_last_k_tokens(body, kept):
    req = parse_completion_request({"prompt": "x", **body}, LIMITS)
    assert prompt_tokens_kept(req, LIMITS.max_model_len) == kept
    prompts = [list(range(2000)), [1, 2, 3]]
    assert truncate_prompts(prompts, kept) == (prompts if kept is None else
                                               [list(range(2000 - kept, 2000)), [1, 2, 3]])


def test_token_id_fields_are_written_only_when_set():
    plain = json.loads(msgspec.json.encode(CompletionChoice(index=0, text="a")))
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    both = json.loads(msgspec.json.encode(CompletionChoice(index=0, text="a", token_ids=[5],
                                                           prompt_token_ids=[1, 2])))
    assert both["token_ids"] == [5] and both["prompt_token_ids"] == [1, 2]


def test_a_field_no_api_defines_is_logged_once_and_inventions_cannot_flood_the_log(
        caplog, monkeypatch):
    import server.protocol

    monkeypatch.setattr(server.protocol, "_logged_unknown", set())  # other tests fill it
    for _ in range(3):
        parse_completion_request({"prompt": "x", "no_such_field_xyz": 1}, LIMITS)
    assert caplog.text.count("no_such_field_xyz") == 1
    parse_completion_request({"prompt": "x", **{f"made_up_{i}": 1 for i in range(500)}},
                             LIMITS)
    assert len(caplog.records) <= MAX_LOGGED_UNKNOWN + 1
