"""The messages between the engine core (scheduler + runner) and its frontend (tokenizing,
detokenizing, stop strings, the HTTP server). The same objects travel in-process (offline
`LLM`) and between processes (msgpack over ZMQ, `server/core_main.py`):

    frontend ──AddSequences / AbortSequences / Shutdown──▶ core loop
    frontend ◀───StepOutput / SequenceFailed / CoreFailed─── core loop   one StepOutput per step
"""
from __future__ import annotations

import msgspec

from engine.core.batch import PromptLogprobs, TokenLogprobs
from engine.core.beam import BeamSearchParams
from engine.core.request import SamplingParams


class CoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One sequence to generate (a request with n choices is n of these), or with `beam` one
    beam search (engine/core/beam.py): seq_id '<id>#0' names its best result, and its results
    are reported, when it ends, as sequences '<id>#<rank>' (`params` is not read)."""
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None  # prefix-cache tenant: hits only its own cached blocks
    priority: int = 0  # vLLM's: lower first, under the priority scheduling policy
    beam: BeamSearchParams | None = None


class SequenceOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step did to one sequence: tokens appended (several when it finishes after
    deferring them, see EngineCore) with their times, prompt logprobs, and its end if it
    ended. Times are time.monotonic(): one clock for every process of a host."""
    seq_id: str
    new_token_ids: list[int]
    new_token_times: list[float]
    new_logprobs: list[TokenLogprobs | None] | None
    finish_reason: str | None
    stop_reason: int | str | None
    finish_time: float | None
    first_scheduled_time: float | None
    num_cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None  # of a prompt chunk (each position once)


class NewTokens(msgspec.Struct, array_like=True, gc=False):
    """One more token, with its time, for each of these sequences: the rows of a step with
    nothing else to report (not their first token, not their last, no logprobs), sent as
    three columns rather than a SequenceOutput each."""
    seq_ids: list[str]
    token_ids: list[int]
    token_times: list[float]


class SpecCounts(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding's cumulative counters (meaning: engine/speculative/stats.py)."""
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    draft_length: int = 0  # k of the step just scheduled (0: it does not speculate)


# EngineStats' cumulative counts that vLLM exports as counters (`vllm:` + name)
ENGINE_COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits")


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """The engine's state after a step, and (num_scheduled_tokens) what that step scheduled."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    spec: SpecCounts | None = None  # None: the engine does not speculate
    # tokens of the step the last step() scheduled (0: idle); each step counted exactly once
    num_scheduled_tokens: int = 0


class StepOutput(msgspec.Struct, array_like=True, gc=False, tag=True):
    """One engine step's results, and the engine's state after it. A sequence appears at
    most once: in `outputs` or in `new_tokens` (most of a decode step's rows)."""
    outputs: list[SequenceOutput]
    stats: EngineStats
    new_tokens: NewTokens | None = None


class CoreFailed(msgspec.Struct, array_like=True, tag=True):
    """The core loop died; its state can no longer be trusted."""
    message: str


class SequenceFailed(msgspec.Struct, array_like=True, tag=True):
    """The core could not take this sequence: a bug (the frontend checks the input first)."""
    seq_id: str
    message: str


class AddSequences(msgspec.Struct, array_like=True, gc=False, tag=True):
    sequences: list[CoreRequest]
    client: int = 0  # which API server sent them (and gets their outputs), 0..N-1


class AbortSequences(msgspec.Struct, array_like=True, gc=False, tag=True):
    seq_ids: list[str]


class Shutdown(msgspec.Struct, array_like=True, tag=True):
    pass


ToCore = AddSequences | AbortSequences | Shutdown
FromCore = StepOutput | SequenceFailed | CoreFailed
