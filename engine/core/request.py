"""Requests and their sampling parameters. Pure Python: the scheduler owns these objects.

A request's tokens are `prompt_token_ids + output_token_ids`. The engine tracks how many of
them already have KV in the cache (`num_computed_tokens`). Every kind of progress is a change
of that one number:

    prefill chunk     num_computed += chunk
    prefix-cache hit  num_computed  = hit tokens (at admission)
    decode            num_computed += 1 (the token sampled last step)
    preemption        num_computed  = 0 (recompute prompt + generated tokens later)
"""
from __future__ import annotations

import enum
import functools
import json
import math
import time
from dataclasses import dataclass, field

EOS_TOKEN_ID = 50256
VOCAB_SIZE = EOS_TOKEN_ID + 1  # GPT-2's tokenizer: EOS is its last id
MAX_LOGPROBS = 20
OUTPUT_KINDS = ("stream", "delta", "final_only")  # SamplingParams.output_kind


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str) -> None:
        # a plain attribute, not a property: read per sequence per step
        self.is_finished = value in ("stop", "length", "abort")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint, kept satisfiable by every token.
    `json`: a schema as canonical JSON text (equal schemas share one compiled grammar);
    `grammar`: EBNF (xgrammar's dialect)."""
    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON without whitespace between tokens (vLLM's disable_any_whitespace)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {list(kinds) or 'none'}")
        if self.choice is not None and not (
                self.choice and all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                             f"got {self.choice!r}")

    @property
    def kinds(self) -> list[str]:
        return [name for name in ("json", "regex", "choice", "grammar")
                if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: its cache key."""
        return (self.kinds[0], getattr(self, self.kinds[0]), self.disable_any_whitespace)


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. Field names and defaults follow vLLM's SamplingParams."""
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per generated token, up to 20
    # vLLM's: every prompt token's logprob after the first, with its top-k (<= 20); None: off
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    # None: every token; else only these may be sampled (vLLM's allowed_token_ids)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words, tokenized: a word's last token is banned wherever its other tokens end
    # the output so far (a one-token word is banned everywhere)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # "stream": an output every step with new text, cumulative fields included; "delta": the
    # same, but an unfinished choice's cumulative fields stay empty (the server streams deltas
    # and need not copy whole histories every step); "final_only": one output at the end
    output_kind: str = "stream"
    structured_outputs: StructuredOutputsParams | None = None  # None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(word) for word in self.bad_words_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_token(v: object) -> bool:
            return is_int(v) and 0 <= v < VOCAB_SIZE

        need(is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        need(is_int(self.max_tokens) and (self.max_tokens >= 1 or self.max_tokens == 0
                                          and self.prompt_logprobs is not None), "max_tokens",
             "must be an integer >= 1 (0 only with prompt_logprobs: the prompt's logprobs "
             "alone)")
        need(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
             "must be a finite number >= 0")
        need(math.isfinite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1 (off) or >= 0")
        need(math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            need(math.isfinite(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name,
                 "must be in [-2, 2]")
        need(math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty,
             "repetition_penalty", "must be a finite number > 0")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens, "min_tokens",
             "must be an integer >= 0")
        need(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs
             <= MAX_LOGPROBS), "logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
             and 0 <= self.prompt_logprobs <= MAX_LOGPROBS), "prompt_logprobs",
             f"must be null or in [0, {MAX_LOGPROBS}]")
        need(all(isinstance(s, str) and s for s in self.stop), "stop",
             "must hold non-empty strings")
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must hold token ids >= 0")
        need(all(is_int(t) and math.isfinite(b) for t, b in self.logit_bias), "logit_bias",
             "must map token ids to finite numbers")
        need(self.allowed_token_ids is None or (
            self.allowed_token_ids and all(is_token(t) for t in self.allowed_token_ids)),
            "allowed_token_ids", f"must be null or a non-empty list of ids in [0, {VOCAB_SIZE})")
        need(all(word and all(is_token(t) for t in word) for word in self.bad_words_token_ids),
             "bad_words_token_ids", f"must hold non-empty lists of ids in [0, {VOCAB_SIZE})")
        if self.seed is not None:
            need(is_int(self.seed), "seed", "must be an integer")
        need(self.output_kind in OUTPUT_KINDS, "output_kind", f"must be one of {OUTPUT_KINDS}")

    @functools.cached_property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @functools.cached_property
    def needs_output_tokens(self) -> bool:
        """The sampler reads the output so far (penalties, bad words): the scheduler sends it,
        and the request neither runs ahead of its last token nor speculates."""
        return self.needs_penalties or bool(self.bad_words_token_ids)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids, plus EOS unless ignore_eos; they end a sequence once min_tokens
        are out."""
        eos = () if self.ignore_eos else (EOS_TOKEN_ID,)
        return frozenset(self.stop_token_ids + eos)

    @functools.cached_property
    def defers_outputs(self) -> bool:
        """A final_only sequence without stop strings or logprobs: the core reports its
        tokens all at once when it finishes, none on the steps before."""
        return self.output_kind == "final_only" and not self.stop and self.logprobs is None

    @functools.cached_property
    def draws_from_raw_logits(self) -> bool:
        """Only the temperature stands between the raw logits and the token (greedy: their
        argmax): no logit bias, token masks, penalties, top-k/top-p/min-p or logprobs
        (min_tokens and structured outputs aside: they depend on the tokens so far)."""
        return self.logprobs is None and self.draws_at_temperature_only

    @functools.cached_property
    def draws_at_temperature_only(self) -> bool:
        """draws_from_raw_logits, logprobs aside (they read the raw logits beside the draw)."""
        return (not self.logit_bias and not self.needs_penalties
                and self.allowed_token_ids is None and not self.bad_words_token_ids
                and self.top_k <= 0 and self.top_p == 1.0 and self.min_p == 0.0)


@dataclass(eq=False)
class Request:
    """One sequence being generated; owned and mutated by the scheduler only. eq=False:
    compared by identity, so a list lookup is not O(tokens)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # its prefix-cache tenant: see BlockManager
    priority: int = 0  # lower is scheduled first, under the priority policy only
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # scheduled in a step still on the device, not yet applied by Scheduler.update
    num_pending_tokens: int = 0
    num_pending_samples: int = 0  # 0 or 1: that step samples this request's next token
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    # prompt positions whose logprobs were reported: each once, whatever preemptions recompute
    num_prompt_logprobs_done: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # timestamps: time.monotonic() seconds
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # kept by append_output_token: read several times per step
    num_output_tokens: int = field(init=False)
    num_tokens: int = field(init=False)
    # the length at which max_tokens ends it; within max_model_len (Scheduler admits only
    # requests that pass check_fits), so it is the one length bound
    max_num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_output_tokens = len(self.output_token_ids)
        self.num_tokens = len(self.prompt_token_ids) + self.num_output_tokens
        self.max_num_tokens = len(self.prompt_token_ids) + self.params.max_tokens

    def append_output_token(self, token: int) -> None:
        """The only way a token joins output_token_ids: keeps the counts."""
        self.output_token_ids.append(token)
        self.num_output_tokens += 1
        self.num_tokens += 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions remain whose logprobs were asked for and not yet reported: their
        logits must be computed, so the request takes no prefix-cache hit."""
        return (self.params.prompt_logprobs is not None
                and self.num_prompt_logprobs_done < len(self.prompt_token_ids) - 1)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
