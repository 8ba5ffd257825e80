"""What the engine hands to its users (the offline LLM and the HTTP server).

RequestMetrics and CompletionOutput are msgspec Structs: the server builds one of each per
streamed chunk, and a Struct is built in C, not by a Python __init__. They hold numbers,
strings and lists of those, never a cycle: gc=False keeps them out of the collector's walks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

import msgspec

from engine.core.batch import TokenLogprobs


class Logprob(msgspec.Struct, gc=False):
    """vLLM's Logprob: a token's raw model logprob at one position, its rank there (1: the
    likeliest; ties count against it) and its text. A Struct: prompt logprobs build up to
    k + 1 per prompt position."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt logprobs: None for prompt token 0 (nothing precedes it), then per prompt
# token a map holding that token's Logprob and those of the top-k tokens at its position
PromptLogprobsList = list[dict[int, Logprob] | None]


class RequestMetrics(msgspec.Struct, gc=False):
    """Timestamps in time.monotonic() seconds, recorded inside the engine."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = msgspec.field(default_factory=list)
    finish_time: float | None = None
    num_cached_tokens: int = 0


class CompletionOutput(msgspec.Struct, gc=False):
    """One of the n choices. `text`/`token_ids`/`logprobs` are cumulative; `delta_*` what this
    step added. Text that may begin a stop string is withheld until known. With output_kind
    "delta" the cumulative fields (and metrics' token_times) stay empty until it finishes."""
    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = msgspec.field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_finish_reason = attrgetter("finish_reason")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # all n choices, by index
    metrics: list[RequestMetrics]  # one per choice
    error: str | None = None  # set when the request failed inside the engine
    # set once every prompt position has them, then shared and never changed; None before
    prompt_logprobs: PromptLogprobsList | None = None
    finished: bool = field(init=False)  # every choice finished; read several times per step

    def __post_init__(self) -> None:
        self.finished = None not in map(_finish_reason, self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
