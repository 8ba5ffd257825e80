"""The API process's work per streamed chunk, counted rather than timed, so that the check
holds on a slow, busy CI machine: the Python function calls that the delta output path makes
(EngineClient's handling of the core's steps, OutputProcessor.process, the stream's
generators and the chunk's encoding) while STREAMS streams take STEPS tokens each, one
token per stream per step, as a GPU core sends them. A call is counted when it runs inside
one of that path's entry points, whatever library it belongs to; the test's own driving and
the event loop's scheduling are not counted. The EngineClient feeds a ServerMetrics, as the
server's does (server/app.py), so the metrics' share of a chunk is counted too.

Stop strings are matched only for the requests that have them, and a chunk framed from a
template is the event the whole chunk's encoding gives."""
from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from engine.core.messages import EngineStats, SequenceOutput, StepOutput
from engine.output import detokenize
from engine.output.tokenizer import Tokenizer
from fakes import ScriptedCore
from server.app import ServerSettings, create_app
from server.chat import ChatCompletionChunk, ChatDelta, ChatService, ChatStreamChoice
from server.completions import ChunkFrame, CompletionService, sse_event, stream_events
from server.engine_client import EngineClient
from server.metrics import ServerMetrics
from server.protocol import CompletionChoice, CompletionResponse, Limits

STREAMS, STEPS = 16, 24
STATS = EngineStats(1, 0, 0.0, 0, 0, 0, 1, 1)
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
# The bounds sit about a tenth above what the path makes today (docs/performance.md, "API
# process per streamed chunk"): room for a helper call, none for another layer per chunk.
MAX_CALLS_PER_CHUNK = {"completions": 34, "chat": 34}
ENTRY_POINTS = {EngineClient._deliver.__code__, EngineClient._on_steps.__code__,
                stream_events.__code__}


class StayingClient:
    """What CompletionService reads of an HTTP request: a receive channel on which the
    client never leaves."""

    async def receive(self) -> dict[str, Any]:
        return await asyncio.get_running_loop().create_future()


class CallCounter:
    """sys.setprofile hook: counts the Python calls made inside the entry points (a call
    whose frame, or a caller's, runs one of their code objects)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frame, event: str, arg: Any) -> None:
        if event != "call":
            return
        while frame is not None:
            if frame.f_code in ENTRY_POINTS:
                self.calls += 1
                return
            frame = frame.f_back


def step(seq_ids: list[str], index: int) -> StepOutput:
    """Step `index` of STEPS: one token for every sequence, varied text; the last ends them."""
    last = index == STEPS - 1
    return StepOutput([SequenceOutput(seq_id, [(index * 7919 + row * 104729) % 50000],
                                      [float(index)], None, "length" if last else None, None,
                                      float(index) if last else None, 0.0, 0)
                       for row, seq_id in enumerate(seq_ids)], STATS)


async def stream(route: str, body: dict[str, Any], counter: CallCounter | None = None
                 ) -> list[bytes]:
    """Every stream's bytes, with `counter` counting while the steps are delivered and
    streamed (request handling before the first step is not counted)."""
    tokenizer = Tokenizer()
    core = ScriptedCore()
    metrics = ServerMetrics("gpt2", core.max_model_len)
    engine = EngineClient(core, tokenizer, max_queued_requests=10_000,
                          observe_output=metrics.observe_output,
                          observe_stats=metrics.observe_stats,
                          observe_request=metrics.observe_request,
                          flush_observations=metrics.flush)
    engine.start()
    completions = CompletionService(engine, tokenizer, "gpt2", Limits(tokenizer.vocab_size,
                                                                       1024))
    service = ChatService(completions, TEMPLATE, False) if route == "chat" else completions
    responses = [await service.create(StayingClient(), body) for _ in range(STREAMS)]
    bodies = [bytearray() for _ in responses]

    async def consume(response, into: bytearray) -> None:
        async for piece in response.body_iterator:
            into += piece

    consumers = [asyncio.create_task(consume(r, b)) for r, b in zip(responses, bodies)]
    await asyncio.sleep(0)  # each consumer waits for its first output
    if counter is not None:
        sys.setprofile(counter)
    try:
        for index in range(STEPS):
            core.deliver(step(core.seq_ids, index))
            for _ in range(4):  # _on_steps runs, then each consumer sends its chunk
                await asyncio.sleep(0)
    finally:
        sys.setprofile(None)
    await asyncio.gather(*consumers)
    await engine.stop(timeout=1.0)
    return [bytes(b) for b in bodies]


def chunks_of(bodies: list[bytes]) -> int:
    return sum(body.count(b"data: ") for body in bodies)


BODIES = {
    "completions": {"prompt": [1, 2, 3], "max_tokens": STEPS, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": STEPS,
             "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}},
}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_streamed_chunk_costs_a_bounded_number_of_python_calls(route):
    counter = CallCounter()
    bodies = asyncio.run(stream(route, BODIES[route], counter))
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    # every step is one chunk per stream: the consumers kept up, nothing was merged
    per_stream = STEPS + 2 + (route == "chat")  # + usage, [DONE]; chat opens with the role
    assert chunks_of(bodies) == STREAMS * per_stream
    calls_per_chunk = counter.calls / (STREAMS * STEPS)
    assert calls_per_chunk <= MAX_CALLS_PER_CHUNK[route], calls_per_chunk


@pytest.mark.parametrize("stop, matched", [(None, False), (["@@@"], True)])
def test_stop_strings_are_matched_only_for_requests_that_have_them(monkeypatch, stop,
                                                                   matched):
    finds = []
    real_find = detokenize.StopStrings.find

    def counting_find(self, text: str, new_from: int):
        finds.append(text)
        return real_find(self, text, new_from)

    monkeypatch.setattr(detokenize.StopStrings, "find", counting_find)
    bodies = asyncio.run(stream("completions", {**BODIES["completions"], "stop": stop}))
    assert chunks_of(bodies) == STREAMS * (STEPS + 2)
    assert bool(finds) == matched


TEXTS = ["", "plain", 'quotes " and \\ backslash', "\u00e9\u4e2d\U0001f600", "\n\t\x00\x1f",
         '"choices":[]', "\ufffd"]  # the last: what a cut character decodes to


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("response_id", ["cmpl-1", 'cmpl-"choices":[]'])
def test_a_framed_chunk_is_the_event_of_the_whole_chunk(text, response_id):
    finishing = {"finish_reason": "stop", "stop_reason": "###"}
    for choice in (CompletionChoice(3, text), CompletionChoice(0, text, **finishing)):
        whole = CompletionResponse(id=response_id, created=1, model="m", choices=[choice])
        frame = ChunkFrame(CompletionResponse(id=response_id, created=1, model="m",
                                              choices=[]))
        assert frame.event(choice) == sse_event(whole)
    for choice in (ChatStreamChoice(1, ChatDelta(content=text)),
                   ChatStreamChoice(0, ChatDelta(content=text), **finishing)):
        whole = ChatCompletionChunk(id=response_id, created=1, model="m", choices=[choice])
        frame = ChunkFrame(ChatCompletionChunk(id=response_id, created=1, model="m",
                                               choices=[]))
        assert frame.event(choice) == sse_event(whole)


class SendWatcher:
    """A middleware that records the types of the messages sent through it."""

    def __init__(self, app, seen: list[str]) -> None:
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send) -> None:
        async def watched(message) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, watched)


async def served_stream(seen: list[str]) -> list[dict]:
    """One streamed completion through the whole ASGI app, with SendWatcher inside its
    middleware stack and a CORS request's Origin; returns what the server's send received."""
    core, received, body = ScriptedCore(), [], json.dumps(BODIES["completions"]).encode()
    app = create_app(core, ServerSettings("gpt2"))
    app.add_middleware(SendWatcher, seen=seen)
    requests = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        return next(requests, None) or await asyncio.get_running_loop().create_future()

    async def send(message) -> None:
        received.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"content-type", b"application/json"), (b"origin", b"http://a")]}
    async with app.router.lifespan_context(app):
        task = asyncio.create_task(app(scope, receive, send))
        while not core.seq_ids:
            await asyncio.sleep(0)
        for index in range(STEPS):
            core.deliver(step(core.seq_ids, index))
            await asyncio.sleep(0)
        await asyncio.wait_for(task, 5.0)
    return received


def test_a_streams_body_skips_the_middlewares_send_wrappers():
    """The response's start passes every middleware (CORS adds its header on the way); each
    body message goes straight to the server's send."""
    seen: list[str] = []
    received = asyncio.run(served_stream(seen))
    assert seen == ["http.response.start"]
    start, *bodies = received
    assert (b"access-control-allow-origin", b"*") in start["headers"]
    text = b"".join(message["body"] for message in bodies)
    assert text.count(b"data: ") == STEPS + 2 and text.endswith(b"data: [DONE]\n\n")
    assert bodies[-1]["more_body"] is False
