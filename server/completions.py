"""POST /v1/completions: from a parsed body to a JSON response or an SSE stream.

A request's prompts become one engine request each (`n` choices fan out inside the engine);
choice `j` of prompt `i` is reported as index `i * n + j`, as OpenAI does. A disconnect
watcher reads the ASGI receive channel, so a client that goes away is noticed at once, even
while its request is still queued and producing nothing, and its engine requests are aborted.
With max_tokens 0 and echo, the prompts are the answer: the engine never sees them unless their
logprobs are asked for (logprobs, or prompt_logprobs), which it then computes without
generating anything (SamplingParams.max_tokens 0).
"""
from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.core.batch import TokenLogprobs
from engine.core.request import SamplingParams, StructuredOutputsParams
from engine.core.scheduler import check_fits
from engine.output.outputs import CompletionOutput, RequestOutput
from engine.output.tokenizer import Tokenizer
from server.beam_search import BeamSearchGeneration, beam_search_params
from server.engine_client import EngineClient, ClientDisconnected, Generation, RequestFailed
from server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                             CompletionResponse, Limits, RequestError, Usage, finite_logprob,
                             max_tokens_of, parse_completion_request, parse_prompt,
                             prompt_logprobs_json, prompt_logprobs_of, prompt_tokens_kept,
                             to_sampling_params, truncate_prompts)
from server.structured_outputs import SpecError, checked_spec

SSE_DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse_event(payload: Any) -> bytes:
    """One Server-Sent Event holding `payload` as JSON (NaN/inf written as null)."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class ChunkFrame:
    """The bytes around the one choice of a streamed chunk that holds no usage:
    `head + json(choice) + tail` is byte for byte the event sse_event writes for that chunk,
    as both are cut from such an event. A chunk's Python work is then one encode."""

    def __init__(self, empty_chunk: Any) -> None:
        """`empty_chunk`: the stream's chunk with `choices` empty and no usage."""
        event = sse_event(empty_chunk)
        cut = event.rindex(b'"choices":[]') + len(b'"choices":[')  # no string holds it unescaped
        self.head, self.tail = event[:cut], event[cut:]

    def event(self, choice: Any) -> bytes:
        return self.head + msgspec.json.encode(choice) + self.tail


SERVER_SEND = "gpt2_serve.server_send"  # the scope key under which server/app.py keeps it


class SSEResponse(StreamingResponse):
    """A generation's event stream. Unlike StreamingResponse it starts no task listening for
    the client's disconnect (with an anyio cancel scope, per request): the request's own
    watcher (`CompletionService.submit`) hears it and ends the body, and uvicorn drops
    whatever is sent to a closed connection. The body is sent from a task of its own, so
    each chunk's wakeup resumes that task's few coroutines rather than every middleware's
    (cancelling the request's task cancels it too).

    The response's start goes through the middlewares' `send` wrappers, which act on it
    alone (they note that a response started; CORS adds its headers); its body messages go
    to the server's own `send` where the app kept it (scope[SERVER_SEND]), past three
    wrapper coroutines a chunk."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.ensure_future(self._send_events(send, scope.get(SERVER_SEND, send)))

    async def _send_events(self, send: Send, send_body: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
        await send_body({"type": "http.response.body", "body": b"", "more_body": False})


class CompletionService:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str,
                 limits: Limits) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.limits = limits

    async def create(self, http_request: Request, body: Any) -> Response:
        req = parse_completion_request(body, self.limits)
        self.check_model(req.model)
        prompts = await self.encode_prompts(parse_prompt(req.prompt, self.limits))
        prompts = truncate_prompts(prompts, prompt_tokens_kept(req, self.limits.max_model_len))
        engine_id = f"cmpl-{uuid.uuid4().hex}"  # unique in the engine, whatever clients send
        # vLLM's request_id field names the response
        response_id = f"cmpl-{req.request_id}" if req.request_id else engine_id
        reply = _Reply(self, req, response_id, prompts)
        if max_tokens_of(req) == 0 and prompt_logprobs_of(req) is None:  # echo only
            return reply.prompt_only()
        if req.use_beam_search:
            generation, watcher = self.submit_beam_search(http_request, engine_id, prompts, req)
        else:
            params = self.sampling_params(req, prompts, await self.structured_outputs(req))
            generation, watcher = self.submit(http_request, engine_id, prompts, params,
                                              req.cache_salt, req.priority or 0)
        if req.stream:
            return SSEResponse(reply.stream(generation, watcher))
        return await reply.collect(generation, watcher)

    def submit(self, http_request: Request, engine_id: str, prompts: list[list[int]],
               params: SamplingParams | list[SamplingParams],
               cache_salt: str | None,
               priority: int = 0) -> tuple[Generation, asyncio.Task[None]]:
        """Queue the prompts, with a watcher that aborts them if the client goes away;
        `finish` ends both."""
        generation = self.engine.generate(engine_id, prompts, params, cache_salt, priority)
        return generation, asyncio.create_task(_cancel_on_disconnect(http_request, generation))

    def submit_beam_search(self, http_request: Request, engine_id: str,
                           prompts: list[list[int]], req: CompletionRequest
                           ) -> tuple[BeamSearchGeneration, asyncio.Task[None]]:
        """use_beam_search: `submit` for a beam search per prompt (server/beam_search.py),
        whose generation the replies read as they read a sampled one."""
        params = beam_search_params(req, prompts, self.limits.max_model_len)
        generation = BeamSearchGeneration(self.engine, self.tokenizer, engine_id, prompts,
                                          params, req.cache_salt, req.priority or 0)
        return generation, asyncio.create_task(_cancel_on_disconnect(http_request, generation))

    def check_model(self, model: str | None) -> None:
        """None or "" is the served model, as in vLLM."""
        if model and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves "
                               f"`{self.model_name}`", param="model", code="model_not_found",
                               status=404)

    async def encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Every prompt's token ids; long texts are tokenized off the event loop."""
        size = sum(len(p) for p in prompts)
        return await off_loop_if_long(size, lambda: [self._encode(p) for p in prompts])

    def _encode(self, prompt: str | list[int]) -> list[int]:
        """The engine's prompt rules (tokenizing, the vocabulary), as 400s."""
        try:
            return self.tokenizer.encode_prompt(prompt)
        except ValueError as exc:
            raise RequestError(f"prompt could not be used: {exc}", param="prompt") from None

    def sampling_params(self, req: CompletionRequest, prompts: list[list[int]],
                        structured: StructuredOutputsParams | None = None
                        ) -> SamplingParams | list[SamplingParams]:
        """One SamplingParams for every prompt, or with max_tokens null one per prompt, each
        up to the end of the context (vLLM's rule). `structured`: the request's checked
        constraint (structured_outputs)."""
        try:
            params = to_sampling_params(req, self.limits.vocab_size)
        except ValueError as exc:  # SamplingParams names the field first
            raise RequestError(str(exc), param=str(exc).split()[0]) from None
        if structured is not None:
            params = replace(params, structured_outputs=structured)
        if max_tokens_of(req) is not None:
            return params
        return [replace(params, max_tokens=max(1, self.limits.max_model_len - len(prompt)))
                for prompt in prompts]

    async def structured_outputs(self, req: CompletionRequest
                                 ) -> StructuredOutputsParams | None:
        """The request's constraint, compiled once as a check: a 400 naming the field when
        it cannot be."""
        try:
            return await checked_spec(req)
        except SpecError as err:
            raise RequestError(str(err), param=err.param) from None

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


# characters (or token ids) below which tokenizing costs less than a hop to a thread; above,
# it leaves the event loop (tiktoken releases the GIL), so a huge prompt stalls no stream
INLINE_WORK = 4096


async def off_loop_if_long(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, in a worker thread when `size` says it is long."""
    if size <= INLINE_WORK:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def _cancel_on_disconnect(http_request: Request, generation: Generation) -> None:
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


def merge_deltas(ready: list[tuple[int, RequestOutput]]) -> list[tuple[int, CompletionOutput]]:
    """Per (prompt, choice), everything these outputs added, as one delta: a stream that fell
    behind sends one chunk per choice, not one per engine step."""
    if len(ready) == 1:  # the usual batch, one step's output: nothing to merge
        prompt_index, output = ready[0]
        return list(zip(itertools.repeat(prompt_index), output.outputs))
    steps: dict[tuple[int, int], list[CompletionOutput]] = {}
    for prompt_index, output in ready:
        for choice in output.outputs:
            steps.setdefault((prompt_index, choice.index), []).append(choice)
    return [(prompt_index, _joined(choices)) for (prompt_index, _), choices in steps.items()]


def _joined(choices: list[CompletionOutput]) -> CompletionOutput:
    """The latest state of a choice, with the deltas of all these steps."""
    last = choices[-1]
    if len(choices) == 1:
        return last
    logprobs = None if all(c.delta_logprobs is None for c in choices) else \
        [entry for c in choices for entry in c.delta_logprobs or ()]
    return msgspec.structs.replace(
        last, delta_text="".join(c.delta_text for c in choices),
        delta_token_ids=[t for c in choices for t in c.delta_token_ids], delta_logprobs=logprobs)


def finish(generation: Generation, watcher: asyncio.Task[None]) -> None:
    watcher.cancel()
    generation.close()


async def collect_outputs(generation: Generation, watcher: asyncio.Task[None]
                          ) -> dict[int, RequestOutput] | Response:
    """Every prompt's last output, by prompt index; or the response to send instead: 499
    when the client went away (nobody reads it), the error when the request failed."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for ready in generation:
            finals.update(ready)
    except ClientDisconnected:
        return Response(status_code=499)
    except RequestFailed as exc:
        return JSONResponse(exc.error.body(), status_code=exc.error.status)
    finally:
        finish(generation, watcher)
    return finals


async def stream_events(generation: Generation, watcher: asyncio.Task[None],
                        events_of: Callable[[list[tuple[int, RequestOutput]]], bytes],
                        closing: Callable[[], bytes]) -> AsyncIterator[bytes]:
    """An SSE body: `events_of(ready)` for each batch of outputs, `closing()` once they are
    all done, then [DONE]. A failed request ends with its error event and [DONE]; a client
    that went away ends it silently. Each batch's events go out as one piece (one write)."""
    try:
        async for ready in generation:
            events = events_of(ready)
            if events:
                yield events
        yield closing() + SSE_DONE
    except ClientDisconnected:
        return
    except RequestFailed as exc:
        yield sse_event(exc.error.body()) + SSE_DONE
    finally:
        finish(generation, watcher)


class _Reply:
    """Builds the response of one request; streaming keeps per-choice state here."""

    def __init__(self, service: CompletionService, req: CompletionRequest, request_id: str,
                 prompts: list[list[int]]) -> None:
        self.service, self.req, self.request_id, self.prompts = service, req, request_id, prompts
        self.n = req.n or 1
        self.created = int(time.time())
        # a chunk carries its text alone, once its choice has started (the echo goes first)
        self.plain = req.logprobs is None and not req.return_token_ids
        self.continuous_usage = req.continuous_usage
        self.frame = ChunkFrame(self._response([], None))
        self.finals: dict[int, RequestOutput] = {}  # latest output per prompt
        self.text_offsets: dict[int, int] = {}  # per choice index, for logprobs
        self.completion_tokens: dict[int, int] = {}  # per choice index, sent so far (usage)
        self.started: set[int] = set()  # choices whose first chunk is built
        self.finish_sent: set[int] = set()

    async def collect(self, generation: Generation, watcher: asyncio.Task[None]) -> Response:
        finals = await collect_outputs(generation, watcher)
        if isinstance(finals, Response):
            return finals
        return self._whole_response(finals)

    def prompt_only(self) -> Response:
        """max_tokens 0 with echo, no logprobs asked for: every choice is its prompt, finished
        by "length", nothing generated. A prompt longer than the context is still refused, as
        vLLM does."""
        max_model_len = self.service.limits.max_model_len
        for prompt in self.prompts:
            try:
                check_fits(len(prompt), 0, max_model_len, pool_tokens=max_model_len)
            except ValueError as exc:  # no KV is needed: only the context length applies
                raise RequestError(str(exc), param="prompt",
                                   code="context_length_exceeded") from None
        ready = [(i, RequestOutput(self.request_id, None, prompt, [
            CompletionOutput(j, finish_reason="length") for j in range(self.n)], []))
            for i, prompt in enumerate(self.prompts)]
        if not self.req.stream:
            return self._whole_response(dict(ready))
        events = self._events(ready) + self._closing() + SSE_DONE
        return StreamingResponse(iter([events]), media_type="text/event-stream")

    def _whole_response(self, finals: dict[int, RequestOutput]) -> Response:
        self.finals = finals
        choices = [self._whole_choice(i, choice) for i in sorted(self.finals)
                   for choice in self.finals[i].outputs]
        # pydantic's JSON writes any stray NaN/inf as null: the body is always valid JSON
        return Response(msgspec.json.encode(self._response(choices, self.usage())),
                        media_type="application/json")

    def stream(self, generation: Generation,
               watcher: asyncio.Task[None]) -> AsyncIterator[bytes]:
        return stream_events(generation, watcher, self._events, self._closing)

    def _events(self, ready: list[tuple[int, RequestOutput]]) -> bytes:
        """One chunk per choice these outputs changed, as one piece."""
        self.finals.update(ready)
        events = []
        for prompt_index, choice in merge_deltas(ready):
            chunk = self._delta_choice(prompt_index, choice)
            if chunk is not None:
                events.append(self._event(prompt_index, chunk))
        return b"".join(events)

    def _event(self, prompt_index: int, chunk: CompletionChoice) -> bytes:
        if not self.continuous_usage:
            return self.frame.event(chunk)
        return sse_event(self._response([chunk], self._usage_so_far(prompt_index, chunk.index)))

    def _closing(self) -> bytes:
        return sse_event(self._response([], self.usage())) if self.req.include_usage else b""

    def _response(self, choices: list[CompletionChoice],
                  usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created,
                                  model=self.service.model_name, choices=choices, usage=usage)

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for out in self.finals.values() for c in out.outputs)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion)

    def _usage_so_far(self, prompt_index: int, index: int) -> Usage:
        """stream_options.continuous_usage_stats: one choice's usage up to this chunk (its
        prompt, its tokens so far), as vLLM counts it."""
        prompt_tokens, completion = len(self.prompts[prompt_index]), self.completion_tokens[index]
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion)

    def _whole_choice(self, prompt_index: int, choice: CompletionOutput) -> CompletionChoice:
        index = prompt_index * self.n + choice.index
        first = self._starts(index)
        prefix = self._echo_prefix(prompt_index, first)
        whole = CompletionChoice(index=index, text=prefix + choice.text,
                                 logprobs=self._logprobs(index, choice.token_ids,
                                                         choice.logprobs, len(prefix),
                                                         self._echoed(prompt_index, first)),
                                 finish_reason=choice.finish_reason,
                                 stop_reason=choice.stop_reason,
                                 **self._prompt_logprobs(prompt_index))
        self._add_token_ids(whole, prompt_index, first, choice.token_ids)
        return whole

    def _delta_choice(self, prompt_index: int,
                      choice: CompletionOutput) -> CompletionChoice | None:
        """The chunk for what this step added to one choice, or None if nothing to send."""
        index = prompt_index * self.n + choice.index
        finishing = choice.finish_reason is not None and index not in self.finish_sent
        if not (choice.delta_text or choice.delta_token_ids or finishing):
            return None
        if finishing:
            self.finish_sent.add(index)
        if self.continuous_usage:
            self.completion_tokens[index] = (self.completion_tokens.get(index, 0)
                                             + len(choice.delta_token_ids))
        chunk = CompletionChoice(index, choice.delta_text,
                                 finish_reason=choice.finish_reason if finishing else None,
                                 stop_reason=choice.stop_reason if finishing else None)
        if self.plain and index in self.started:
            return chunk
        first = self._starts(index)
        prefix = self._echo_prefix(prompt_index, first)
        chunk.text = prefix + chunk.text
        chunk.logprobs = self._logprobs(index, choice.delta_token_ids, choice.delta_logprobs,
                                        len(prefix), self._echoed(prompt_index, first))
        self._add_token_ids(chunk, prompt_index, first, choice.delta_token_ids)
        return chunk

    def _starts(self, index: int) -> bool:
        """Whether this is the choice's first chunk (or its whole): the prompt goes there."""
        first = index not in self.started
        self.started.add(index)
        return first

    def _echo_prefix(self, prompt_index: int, first: bool) -> str:
        if self._echoed(prompt_index, first) is None:
            return ""
        return self.service.tokenizer.decode(self.prompts[prompt_index])

    def _echoed(self, prompt_index: int, first: bool) -> int | None:
        """The prompt this chunk echoes (with echo, a choice's first chunk), or None."""
        return prompt_index if self.req.echo and first else None

    def _prompt_logprobs(self, prompt_index: int) -> dict[str, Any]:
        """vLLM's prompt_logprobs field, where the engine computed them."""
        entries = self.finals[prompt_index].prompt_logprobs
        if prompt_logprobs_of(self.req) is None or entries is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(entries)}

    def _add_token_ids(self, choice: CompletionChoice, prompt_index: int, first: bool,
                       token_ids: list[int]) -> None:
        """return_token_ids: the prompt's ids (in the first chunk) and these tokens' ids."""
        if not self.req.return_token_ids:
            return
        choice.token_ids = list(token_ids)
        if first:
            choice.prompt_token_ids = self.prompts[prompt_index]

    def _logprobs(self, index: int, token_ids: list[int],
                  logprobs: list[TokenLogprobs | None] | None, skip: int,
                  echoed: int | None = None) -> CompletionLogprobs | None:
        """OpenAI's logprobs of these tokens, their text offsets `skip` characters on. With
        `echoed`, that prompt's tokens come first, offsets from 0, with their prompt logprobs
        (none for the first token: nothing precedes it), as OpenAI and vLLM echo them."""
        if self.req.logprobs is None:
            return None
        result = CompletionLogprobs()
        if echoed is not None:
            self._add_logprobs(result, self.prompts[echoed], self._prompt_entries(echoed), 0)
        self.text_offsets[index] = self._add_logprobs(
            result, token_ids, logprobs or [], self.text_offsets.get(index, 0) + skip)
        return result

    def _add_logprobs(self, result: CompletionLogprobs, token_ids: list[int],
                      logprobs: list[TokenLogprobs | None], offset: int) -> int:
        """Append these tokens' entries to `result`; returns the offset past them."""
        for token_id, entry in zip(token_ids, logprobs):
            name = self._token_name(token_id)
            result.tokens.append(name)
            result.text_offset.append(offset)  # into the text, whatever the tokens' names
            offset += len(self.service.token_text(token_id))
            result.token_logprobs.append(
                None if entry is None else finite_logprob(entry.token_logprob))
            result.top_logprobs.append(None if entry is None else self._top(entry, name))
        return offset

    def _prompt_entries(self, prompt_index: int) -> list[TokenLogprobs | None]:
        """The prompt's logprobs, one entry per token (None for the first), each with every
        token of its position's map (see _echoed_entry)."""
        logprobs = self.finals[prompt_index].prompt_logprobs
        if logprobs is None:
            return [None] * len(self.prompts[prompt_index])
        return [None, *itertools.starmap(_echoed_entry, logprobs.rows())]

    def _token_name(self, token_id: int) -> str:
        """A logprob token's text, or with return_tokens_as_token_ids "token_id:<id>" (two
        tokens of one text, or a part of a character, stay told apart)."""
        if self.req.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self.service.token_text(token_id)

    def _top(self, entry: TokenLogprobs, sampled_name: str) -> dict[str, float]:
        top = {self._token_name(t): finite_logprob(lp)
               for t, lp in zip(entry.top_token_ids, entry.top_logprobs)}
        top.setdefault(sampled_name, finite_logprob(entry.token_logprob))
        return top


def _echoed_entry(token: int, logprob: float, rank: int, top_ids: list[int],
                  top_logprobs: list[float]) -> TokenLogprobs:
    """One prompt position's row (FlatPromptLogprobs.rows) in its map's order: the token
    first, with its top-k logprob when among the top-k, then the rest of the top-k."""
    if token not in top_ids:
        return TokenLogprobs(logprob, [token, *top_ids], [logprob, *top_logprobs])
    i = top_ids.index(token)
    own = top_logprobs[i]
    return TokenLogprobs(own, [token, *top_ids[:i], *top_ids[i + 1:]],
                         [own, *top_logprobs[:i], *top_logprobs[i + 1:]])
