"""Request and response shapes of the OpenAI-compatible API, and every input check.

Parsing never raises pydantic's ValidationError to the caller: `parse_completion_request`
turns every problem into a `RequestError` naming the offending field, which the app answers
with HTTP 400 in OpenAI's error shape. Checks that need the model (vocabulary size, the n cap)
take a `Limits`. Rules the engine owns (SamplingParams' values, the vocabulary, whether a
request fits the context and the KV pool) are the engine's: the server translates their
ValueErrors into 400s.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, \
    ValidationError

from engine.core.request import MAX_LOGPROBS, SamplingParams
from engine.output.outputs import FlatPromptLogprobs
from engine.output.tokenizer import Tokenizer, check_token_ids, is_token_list
from server.structured_outputs import SpecError, StructuredFields, spec_of

LOGIT_BIAS_LIMIT = 100.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
logger = logging.getLogger("gpt2serve")


class RequestError(Exception):
    """A client mistake: answered with `status` and OpenAI's error body, naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value",
                 status: int = 400, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.status, self.err_type = status, err_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What the served model allows; checks that depend on it read it from here."""
    vocab_size: int
    max_model_len: int
    max_n: int = 16
    max_prompts: int = 2048  # prompts per request, as OpenAI allows
    priority_scheduling: bool = False  # the engine's policy is priority: `priority` works


Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    """NaN and inf are refused at parse time, so they never reach the engine or a response."""
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = True  # vLLM's default: stream_options {} asks for usage
    continuous_usage_stats: StrictBool | None = False  # usage in every chunk too


class CompletionRequest(_Strict, StructuredFields):
    """POST /v1/completions. `None` means "use the default", as OpenAI clients send nulls.
    The structured-output fields come from server/structured_outputs.py."""
    model: str | None = None
    prompt: Any = None
    max_tokens: Annotated[StrictInt, Field(ge=0, le=INT64_MAX)] | None = None  # 0: echo only
    temperature: Annotated[StrictFloat, Field(ge=0.0)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    best_of: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = False
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    suffix: str | None = None
    # vLLM extras
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0)] | None = None
    ignore_eos: StrictBool | None = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated, tokenized as vLLM does
    include_stop_str_in_output: StrictBool | None = False
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # per-tenant prefix cache
    # lower is scheduled first; other than 0 only under --scheduling-policy priority
    priority: Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    add_special_tokens: StrictBool | None = True  # GPT-2 adds none: both values are the same
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1, le=INT64_MAX)] | None = None
    return_token_ids: StrictBool | None = None  # choices carry prompt_token_ids, token_ids
    return_tokens_as_token_ids: StrictBool | None = None  # logprob tokens as "token_id:<id>"
    # beam search (server/beam_search.py): n is its width; early_stopping as transformers has it
    use_beam_search: StrictBool | None = False
    length_penalty: StrictFloat | None = 1.0
    early_stopping: StrictBool | Literal["never"] | None = False
    # each prompt token's logprob and the top-k at its position (each choice's prompt_logprobs)
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @property
    def include_usage(self) -> bool:
        """A last chunk, before [DONE], holds the whole request's usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk holds its choice's usage so far (vLLM asks for include_usage too; here
        either works alone, so neither is ignored)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool | None = True  # accepted for vLLM parity; GPT-2 adds none


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[StrictInt]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validation_error_to_request_error(err: ValidationError) -> RequestError:
    """Report the first problem, named by its top-level field (the `param` OpenAI uses)."""
    first = err.errors()[0]
    loc = [str(part) for part in first["loc"]]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    message = f"{where}: {first['msg']}"
    if first["type"] != "missing":
        message += f" (got {_describe(first.get('input'))})"
    return RequestError(message, param=param)


def request_body_schema(model_cls: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI's requestBody for a route that parses its body by hand (`parse_model`), so
    clients and schema fuzzers see its fields. Nested models are inlined: the schema stands
    alone, outside the document's components."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": inline(schema)}}}}


# vLLM request fields this server knows but does not implement yet, with the values that ask
# for nothing (what clients send unasked): any other value is a 400 naming the field, never
# silently ignored. Fields in neither this table nor the request model are logged, once per
# name, as vLLM does.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "logits_processors": (([],), "custom logits processors are not supported"),
    # GPT-2's one special token, <|endoftext|>, is left out of the text (vLLM's default,
    # skip_special_tokens=True); spacing between specials is then moot
    "skip_special_tokens": ((True,), "<|endoftext|> never enters the text"),
    "spaces_between_special_tokens": ((True, False), "it takes true or false"),
    "guided_whitespace_pattern": ((), "xgrammar takes no whitespace pattern; "
                                  "structured_outputs.disable_any_whitespace is its option"),
    **{name: ((), f"{name} is not supported") for name in (
        "kv_transfer_params", "vllm_xargs", "prompt_embeds")},
}
_logged_unknown: set[str] = set()
MAX_LOGGED_UNKNOWN = 64  # distinct names: a client inventing names cannot flood the log


def _log_unknown_once(name: str) -> None:
    if name in _logged_unknown or len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
        return
    _logged_unknown.add(name)
    if len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
        logger.warning("requests hold more than %d fields that no API defines: no more are "
                       "logged", MAX_LOGGED_UNKNOWN)
    else:
        logger.warning("requests hold the field %r, which no API defines: ignored",
                       name[:64])


def check_field_support(body: dict[str, Any], model_cls: type[BaseModel]) -> None:
    """400 for a known but unimplemented field asking for something; a warning, once per
    name, for a field nobody defines."""
    for name, value in body.items():
        if name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if value is not None and not any(type(value) is type(v) and value == v
                                             for v in neutral):
                raise RequestError(f"{name} is not supported by this server: {why}",
                                   param=name, code="unsupported_field")
        elif name not in model_cls.model_fields:
            _log_unknown_once(name)


def parse_model(model_cls: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(body)
    except ValidationError as err:
        raise validation_error_to_request_error(err) from None


def parse_completion_request(body: Any, limits: Limits) -> CompletionRequest:
    request = parse_model(CompletionRequest, body)
    check_field_support(body, CompletionRequest)
    _check_cross_fields(request, limits)
    _check_beam_search(request)
    check_priority(request.priority, limits)
    parse_prompt(request.prompt, limits)
    _check_stop(request, limits.vocab_size)
    _check_token_masks(request, limits.vocab_size)
    parse_logit_bias(request.logit_bias, limits.vocab_size)
    return request


def check_priority(priority: int | None, limits: Limits) -> None:
    """vLLM's rule: a priority other than 0 (or null) needs the priority scheduling policy."""
    if priority and not limits.priority_scheduling:
        raise RequestError("priority is not supported by this server: its scheduling policy "
                           "is fcfs (start it with --scheduling-policy priority)",
                           param="priority", code="unsupported_field")


# The completion fields beam search does not take, with the values that ask for nothing: it
# ranks the model's raw logprobs and ends a beam at EOS or max_tokens only.
NOT_WITH_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "logprobs": (None,), "prompt_logprobs": (None,), "stop": (None, []),
    "stop_token_ids": (None, []), "top_p": (None, 1.0), "top_k": (None, -1, 0),
    "min_p": (None, 0.0), "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0), "seed": (None,), "logit_bias": (None, {}),
    "min_tokens": (None, 0), "allowed_token_ids": (None,), "bad_words": (None, []),
}
BEAM_ONLY = {"length_penalty": 1.0, "early_stopping": False}  # and their neutral values


def _check_beam_search(req: CompletionRequest) -> None:
    """use_beam_search takes n as its width, up to MAX_LOGPROBS // 2 (a step asks for 2n
    logprobs), and none of the fields it would ignore; length_penalty and early_stopping
    apply to beam search only."""
    if not req.use_beam_search:
        for name, neutral in BEAM_ONLY.items():
            if getattr(req, name) not in (None, neutral):
                raise RequestError(f"{name} applies to beam search only: send it with "
                                   "use_beam_search: true", param=name)
        return
    if (req.n or 1) > MAX_LOGPROBS // 2:
        raise RequestError(f"n is the beam width with use_beam_search: at most "
                           f"{MAX_LOGPROBS // 2}, got {req.n}", param="n")
    for name, neutral in NOT_WITH_BEAM_SEARCH.items():
        if getattr(req, name) not in neutral:
            raise RequestError(f"{name} cannot be used with use_beam_search: beam search ranks "
                               "the model's raw logprobs and ends a beam at EOS or max_tokens "
                               "only", param=name)
    try:
        constrained = spec_of(req)
    except SpecError as err:
        raise RequestError(str(err), param=err.param) from None
    if constrained is not None:
        raise RequestError(f"{constrained[1]} cannot be used with use_beam_search: beam search "
                           "does not constrain its tokens", param=constrained[1])


def _check_cross_fields(req: CompletionRequest, limits: Limits) -> None:
    n = req.n or 1
    if n > limits.max_n:
        raise RequestError(f"n must be at most {limits.max_n}, got {n}", param="n")
    if n > 1 and req.temperature == 0.0 and not req.use_beam_search:
        raise RequestError(f"n={n} with temperature=0 (greedy) would return {n} identical "
                           "choices; use n=1 or a temperature > 0", param="n")
    if req.best_of is not None and req.best_of != n:
        raise RequestError("best_of is not supported unless it equals n", param="best_of")
    if req.suffix is not None:
        raise RequestError("suffix is not supported", param="suffix")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true",
                           param="stream_options")
    if req.stream and req.prompt_logprobs:  # vLLM's rule: 0 computes them and sends none
        raise RequestError("`prompt_logprobs` are not available when `stream=True`.",
                           param="prompt_logprobs")
    limit = max_tokens_of(req)
    if limit == 0 and not req.echo:
        raise RequestError("max_tokens must be at least 1, got 0 (0 is allowed with echo=true "
                           "only, which returns the prompt alone)", param="max_tokens")
    _check_truncation(req.truncate_prompt_tokens, limits.max_model_len)
    if limit is not None and (req.min_tokens or 0) > limit:
        raise RequestError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens "
                           f"({limit})", param="min_tokens")


def _check_truncation(keep: int | None, max_model_len: int) -> None:
    if keep == 0:
        raise RequestError("truncate_prompt_tokens must be -1 (all that fit beside max_tokens) "
                           "or at least 1, got 0", param="truncate_prompt_tokens")
    if keep is not None and keep > max_model_len:
        raise RequestError(f"truncate_prompt_tokens ({keep}) must not exceed the model's "
                           f"context length, max_model_len ({max_model_len})",
                           param="truncate_prompt_tokens")


def prompt_tokens_kept(req: CompletionRequest, max_model_len: int) -> int | None:
    """How many of each prompt's last tokens truncate_prompt_tokens keeps; None: all. -1 is
    as many as leave room for max_tokens, as in vLLM (max_tokens null: room for one)."""
    keep = req.truncate_prompt_tokens
    if keep != -1:
        return keep
    limit = max_tokens_of(req)
    return max(1, max_model_len - (1 if limit is None else limit))


def truncate_prompts(prompts: list[list[int]], keep: int | None) -> list[list[int]]:
    """Each prompt's last `keep` tokens (all of them when `keep` is None)."""
    if keep is None:
        return prompts
    return [prompt[-keep:] if len(prompt) > keep else prompt for prompt in prompts]


PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def parse_prompt(prompt: Any, limits: Limits) -> list[str | list[int]]:
    """Normalise the four OpenAI prompt forms into a list of prompts (text or token ids).
    The prompt count is checked before any prompt is: each costs work to check and queue."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    elif isinstance(prompt, list):
        raise RequestError("prompt must not be empty", param="prompt")
    else:
        raise RequestError(f"prompt must be {PROMPT_FORMS}", param="prompt",
                           code="invalid_type")
    if len(prompts) > limits.max_prompts:
        raise RequestError(f"a request may hold at most {limits.max_prompts} prompts, got "
                           f"{len(prompts)}", param="prompt", code="too_many_prompts")
    for i, one in enumerate(prompts):
        _check_one_prompt(one, i)
    return prompts


def _check_one_prompt(prompt: Any, index: int) -> None:
    """The prompt's form; its token ids are the engine's to check (Tokenizer.encode_prompt)."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"prompt[{index}] must not be an empty string", param="prompt")
        return
    if not isinstance(prompt, list) or not is_token_list(prompt):
        raise RequestError(f"prompt must be {PROMPT_FORMS}", param="prompt",
                           code="invalid_type")
    if not prompt:
        raise RequestError(f"prompt[{index}] must not be an empty token list", param="prompt")


def _check_stop(req: CompletionRequest, vocab_size: int) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty", param="stop")
    check_tokens_in_vocab(req.stop_token_ids or [], vocab_size, param="stop_token_ids")


def _check_token_masks(req: CompletionRequest, vocab_size: int) -> None:
    """vLLM's rules: allowed_token_ids, when sent, is a non-empty list of vocabulary ids;
    each bad word holds more than spaces (an empty word would ban nothing, silently)."""
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids:
            raise RequestError("allowed_token_ids must not be empty (null allows every token)",
                               param="allowed_token_ids")
        check_tokens_in_vocab(req.allowed_token_ids, vocab_size, param="allowed_token_ids")
    for i, word in enumerate(req.bad_words or ()):
        if not word.strip():
            raise RequestError(f"bad_words[{i}] must hold a word, got {_describe(word)}",
                               param="bad_words")


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """Keys are token ids written as strings; values are clamped to ±100 as OpenAI does."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        token = _parse_int(key)
        if token is None or not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias key {key!r} is not a token id in "
                               f"[0, {vocab_size})", param="logit_bias")
        parsed[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
    return parsed


def _parse_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def check_tokens_in_vocab(tokens: list[int], vocab_size: int, param: str) -> None:
    """The engine's vocabulary rule, as a 400 naming the field."""
    try:
        check_token_ids(tokens, vocab_size, param)
    except ValueError as exc:
        raise RequestError(str(exc), param=param) from None


def to_sampling_params(req: CompletionRequest, vocab_size: int) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return SamplingParams(
        n=req.n or 1, max_tokens=_default(max_tokens_of(req), 1),  # null: the caller's
        prompt_logprobs=prompt_logprobs_of(req),
        temperature=_default(req.temperature, 1.0), top_p=_default(req.top_p, 1.0),
        top_k=_default(req.top_k, -1), min_p=_default(req.min_p, 0.0), seed=req.seed,
        stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        ignore_eos=bool(req.ignore_eos), min_tokens=req.min_tokens or 0,
        presence_penalty=_default(req.presence_penalty, 0.0),
        frequency_penalty=_default(req.frequency_penalty, 0.0),
        repetition_penalty=_default(req.repetition_penalty, 1.0), logprobs=req.logprobs,
        logit_bias=tuple(parse_logit_bias(req.logit_bias, vocab_size).items()),
        allowed_token_ids=None if req.allowed_token_ids is None else
        tuple(req.allowed_token_ids),
        bad_words_token_ids=tuple(map(tuple, Tokenizer().bad_words_token_ids(
            req.bad_words or []))),
        output_kind="delta")  # the server streams deltas and answers from the final output


def max_tokens_of(req: CompletionRequest) -> int | None:
    """The request's max_tokens: 16 when left out, None when sent as null (vLLM's "the rest
    of the context", which differs per prompt)."""
    if req.max_tokens is None and "max_tokens" in req.model_fields_set:
        return None
    return _default(req.max_tokens, 16)


def prompt_logprobs_of(req: CompletionRequest) -> int | None:
    """The top-k of the prompt logprobs the engine computes: prompt_logprobs, or with echo
    the logprobs, which then cover the echoed prompt too (vLLM's rule); None: none."""
    if req.prompt_logprobs is None and req.echo:
        return req.logprobs
    return req.prompt_logprobs


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


# ---- responses ----------------------------------------------------------------------------

# Response shapes: msgspec Structs, encoded straight to JSON (msgspec.json.encode) once per
# streamed chunk: several times cheaper than pydantic's model_dump_json on this hot path.
# Non-finite floats are written as null, so the JSON stays valid.

class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    """`prompt_token_ids` and `token_ids` (vLLM's return_token_ids) are left out of the JSON
    unless asked for; streamed, the prompt's come in a choice's first chunk, and `token_ids`
    are each chunk's own."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    # vLLM's, whenever the engine computed them (prompt_logprobs, or echo with logprobs);
    # never streamed
    prompt_logprobs: PromptLogprobsJSON | msgspec.UnsetType = msgspec.UNSET


class PromptLogprob(msgspec.Struct):
    """One token of one position of vLLM's prompt_logprobs."""
    logprob: float
    rank: int | None
    decoded_token: str | None


# None for the first prompt token, then per token a map from token ids (JSON keys: strings)
PromptLogprobsJSON = list[dict[int, PromptLogprob] | None]


def prompt_logprobs_json(logprobs: FlatPromptLogprobs) -> PromptLogprobsJSON:
    """The engine's (complete) prompt logprobs as vLLM answers them, logprobs made finite:
    FlatPromptLogprobs' maps, read from its columns."""
    return [None, *logprobs.maps(_finite_prompt_logprob)]


def _finite_prompt_logprob(logprob: float, rank: int, text: str) -> PromptLogprob:
    return PromptLogprob(finite_logprob(logprob), rank, text)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(msgspec.Struct, kw_only=True):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def finite_logprob(value: float) -> float:
    """JSON has no NaN or inf; vLLM clamps the same way: below -9999.0, NaN and +-inf become
    -9999.0. One comparison chain, no call: it runs per logprob of a response."""
    return value if -9999.0 <= value < math.inf else -9999.0
