"""use_beam_search on /v1/completions and /v1/chat/completions: one engine/beam_search.py
search per prompt, each step run as one-token requests through EngineClient.generate, as
vLLM's server runs it.

`BeamSearchGeneration` has a `Generation`'s interface (async iteration, `cancel`, `close`).
It yields once, when every search has finished: each prompt's RequestOutput, its choices the
best n beams, best first, whole (also as deltas: a stream sends each beam as one chunk, then
[DONE], as vLLM streams beam search).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from engine.beam_search import BeamSearch, BeamSearchParams, BeamSearchSequence, step_result
from engine.core.request import SamplingParams
from engine.output.outputs import CompletionOutput, RequestOutput
from engine.output.tokenizer import Tokenizer
from server.engine_client import EngineClient, Generation, Ready, RequestFailed
from server.protocol import CompletionRequest, RequestError, max_tokens_of


def beam_search_params(req: CompletionRequest, prompts: list[list[int]],
                       max_model_len: int) -> list[BeamSearchParams]:
    """Each prompt's search: n beams; max_tokens null is the rest of that prompt's context;
    temperature, as in vLLM, 1.0 when left out."""
    limit = max_tokens_of(req)
    try:
        return [BeamSearchParams(
            beam_width=req.n or 1,
            max_tokens=limit if limit is not None else max(1, max_model_len - len(prompt)),
            ignore_eos=bool(req.ignore_eos),
            temperature=1.0 if req.temperature is None else req.temperature,
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            early_stopping=False if req.early_stopping is None else req.early_stopping)
            for prompt in prompts]
    except ValueError as exc:  # BeamSearchParams names the field first
        raise RequestError(str(exc), param=str(exc).split()[0]) from None


class BeamSearchGeneration:
    """The beam searches of one HTTP request. Creating it checks the whole search's
    admission and queues the first step, so a refusal is a 400/503 before any response
    starts; a later step the engine refuses fails the request (RequestFailed)."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, request_id: str,
                 prompts: list[list[int]], params: list[BeamSearchParams],
                 cache_salt: str | None, priority: int) -> None:
        engine.check_admission(prompts, [SamplingParams(n=p.beam_width, max_tokens=p.max_tokens)
                                         for p in params])
        self._engine, self._tokenizer, self._request_id = engine, tokenizer, request_id
        self._cache_salt, self._priority = cache_salt, priority
        self._searches = [BeamSearch(prompt, p) for prompt, p in zip(prompts, params)]
        self._num_steps = 0
        self._in_flight: list[tuple[BeamSearch, int]] = []  # searches and their requests
        self._step: Generation | None = self._start_step()

    def __aiter__(self) -> AsyncIterator[Ready]:
        return self._iterate()

    def cancel(self) -> None:
        """The client disconnected: abort the step in flight, whose iteration then raises
        ClientDisconnected."""
        if self._step is not None:
            self._step.cancel()

    def close(self) -> None:
        """Abort the step in flight, if any. Idempotent."""
        if self._step is not None:
            self._step.close()

    async def _iterate(self) -> AsyncIterator[Ready]:
        while self._step is not None:
            outputs = iter(await _finals(self._step))
            for search, count in self._in_flight:
                search.advance([step_result(next(outputs)) for _ in range(count)])
            self._step = self._next_step()
        yield [(index, self._output(search)) for index, search in enumerate(self._searches)]

    def _next_step(self) -> Generation | None:
        try:
            return self._start_step()
        except RequestError as err:  # the queue filled up, or the engine died, meanwhile
            raise RequestFailed(err.message, err.status, err.code) from None

    def _start_step(self) -> Generation | None:
        """Queue one one-token request per live beam of every unfinished search; None once
        every search has finished."""
        batches = [(search, search.requests()) for search in self._searches
                   if not search.finished]
        self._in_flight = [(search, len(batch)) for search, batch in batches]
        if not batches:
            return None
        self._num_steps += 1
        return self._engine.generate(
            f"{self._request_id}-beam{self._num_steps}",
            [tokens for _, batch in batches for tokens in batch],
            [search.step_params for search, batch in batches for _ in batch],
            self._cache_salt, self._priority)

    def _output(self, search: BeamSearch) -> RequestOutput:
        choices = [self._choice(index, seq) for index, seq in enumerate(search.result())]
        return RequestOutput(request_id=self._request_id, prompt=None,
                             prompt_token_ids=search.prompt_token_ids, outputs=choices,
                             metrics=[])

    def _choice(self, index: int, seq: BeamSearchSequence) -> CompletionOutput:
        text = self._tokenizer.decode(seq.text_token_ids(with_prompt=False))
        tokens = seq.output_token_ids
        return CompletionOutput(index=index, text=text, token_ids=tokens,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                delta_text=text, delta_token_ids=tokens)


async def _finals(step: Generation) -> list[RequestOutput]:
    """The step's outputs, in the order of its requests (one-token requests finish in one
    output each)."""
    finals: dict[int, RequestOutput] = {}
    async for ready in step:
        finals.update(ready)
    return [finals[index] for index in range(len(finals))]
