"""use_beam_search on /v1/completions and /v1/chat/completions: one beam search per prompt,
each run inside the engine core (engine/core/beam.py) as one request of EngineClient.generate,
whose n choices are the search's results.

`BeamSearchGeneration` has a `Generation`'s interface (async iteration, `cancel`, `close`).
It yields once, when every search has finished: each prompt's RequestOutput, its choices the
best n beams, best first, whole (also as deltas: a stream sends each beam as one chunk, then
[DONE], as vLLM streams beam search).
"""
from __future__ import annotations

from collections.abc import AsyncIterator

from engine.beam_search import (BeamSearchParams, BeamSearchSequence, beam_sequences,
                                search_params)
from engine.core.beam import SearchTooLarge, check_search_fits
from engine.output.outputs import CompletionOutput, RequestOutput
from engine.output.tokenizer import Tokenizer
from server.engine_client import CoreConnection, EngineClient, Ready
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
    """The beam searches of one HTTP request. Creating it checks their admission and queues
    them, so a refusal is a 400/503 before any response starts; a search the engine fails
    fails the request (RequestFailed)."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, request_id: str,
                 prompts: list[list[int]], params: list[BeamSearchParams],
                 cache_salt: str | None, priority: int) -> None:
        self._tokenizer, self._request_id, self._params = tokenizer, request_id, params
        _check_fits(prompts, params, engine.connection)
        self._searches = engine.generate(request_id, prompts, [search_params(p) for p in params],
                                         cache_salt, priority, beam=params)

    def __aiter__(self) -> AsyncIterator[Ready]:
        return self._iterate()

    def cancel(self) -> None:
        """The client disconnected: abort the searches, whose iteration then raises
        ClientDisconnected."""
        self._searches.cancel()

    def close(self) -> None:
        """Abort the searches that have not finished. Idempotent."""
        self._searches.close()

    async def _iterate(self) -> AsyncIterator[Ready]:
        finals: dict[int, RequestOutput] = {}
        async for ready in self._searches:
            finals.update(ready)
        yield [(index, self._output(finals[index], self._params[index]))
               for index in sorted(finals)]

    def _output(self, output: RequestOutput, params: BeamSearchParams) -> RequestOutput:
        choices = [self._choice(index, seq)
                   for index, seq in enumerate(beam_sequences(output, params))]
        return RequestOutput(request_id=self._request_id, prompt=None,
                             prompt_token_ids=output.prompt_token_ids, outputs=choices,
                             metrics=[])

    def _choice(self, index: int, seq: BeamSearchSequence) -> CompletionOutput:
        text = self._tokenizer.decode(seq.text_token_ids(with_prompt=False))
        tokens = seq.output_token_ids
        return CompletionOutput(index=index, text=text, token_ids=tokens,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                delta_text=text, delta_token_ids=tokens)


def _check_fits(prompts: list[list[int]], params: list[BeamSearchParams],
                core: CoreConnection) -> None:
    """400 for a search the core would never admit: its worst case holds more blocks than
    the KV pool or more beams than max_num_seqs (the core's own check)."""
    for prompt, p in zip(prompts, params):
        try:
            check_search_fits(len(prompt), p, core.block_size,
                              core.pool_tokens // core.block_size, core.max_num_seqs)
        except SearchTooLarge as exc:
            code = "context_length_exceeded" if exc.param == "max_tokens" else "too_many_sequences"
            raise RequestError(str(exc), param=exc.param, code=code) from None
