"""Server behaviour under pressure and at its edges: the API key, the waiting-queue cap (503,
then recovery), engine-side rejections, failure containment, and SIGTERM drain."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from engine import SamplingParams
from engine.build import build_engine_core
from engine.core.config import load_config
from engine.core.engine_core import EngineCore
from engine.output.tokenizer import Tokenizer
from server.engine_client import EngineClient, RequestFailed
from core_thread import CoreThread
from server.protocol import RequestError
from server_harness import ServerProcess, metric, wait_for

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"prompt": "keep going", "max_tokens": 600, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """One sequence at a time and a 2-request waiting queue make the queue easy to fill."""
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--max-num-seqs", "1", "--max-queued-requests", "2",
                         "--num-kv-blocks", "40", "--api-key", KEY,
                         "--shutdown-timeout", "20")
    yield proc
    proc.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def test_api_key_guards_v1_routes_only(server):
    url = server.url
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}
                     ).status_code == 401
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).status_code == 200
    for sneaky in ("/%76%31/models", "/%2Fv1/models", "//v1/models", "/V1/models"):
        assert httpx.get(url + sneaky).status_code in (401, 404), sneaky
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + open_path).status_code == 200, open_path


def test_http_conventions(server, http):
    """405 names the allowed methods, 401 the auth scheme; the API describes itself."""
    not_allowed = http.get("/v1/completions")
    assert not_allowed.status_code == 405 and not_allowed.headers["allow"] == "POST"
    assert not_allowed.json()["error"]["code"] == "405"
    unauthorized = httpx.get(server.url + "/v1/models")
    assert unauthorized.headers["www-authenticate"] == "Bearer"
    schema = http.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert http.get("/docs").status_code == 200


def test_a_request_larger_than_the_queue_cap_is_refused_outright(http):
    """The cap counts sequences, prompts x n: a single request must not bypass it."""
    for body in ({"prompt": ["a", "b", "c"], "max_tokens": 1},
                 {"prompt": "a", "n": 3, "temperature": 1.0, "max_tokens": 1}):
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "too_many_sequences"
    assert http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}
                     ).status_code == 200


def test_engine_side_rejection_is_a_400(http):
    """40 blocks of 16 hold 640 tokens, under the 1024 context: only the engine knows."""
    response = http.post("/v1/completions", json={"prompt": [5] * 600, "max_tokens": 40})
    assert response.status_code == 200
    response = http.post("/v1/completions", json={"prompt": [5] * 600, "max_tokens": 41})
    assert response.status_code == 400, response.text
    assert "640" in response.json()["error"]["message"]


def open_stream(http: httpx.Client, body: dict):
    """Enter a streaming request: returns once the headers arrived (the engine took it)."""
    context = http.stream("POST", "/v1/completions", json=body)
    response = context.__enter__()
    assert response.status_code == 200, response.read()
    return context, response


def test_queue_cap_answers_503_then_recovers(server, http):
    running_ctx, running = open_stream(http, LONG)
    lines = running.iter_lines()  # keep a reference: a collected iterator closes the stream
    assert next(lines).startswith("data: ")  # producing: no longer waiting
    queued = [open_stream(http, LONG) for _ in range(2)]  # max_num_seqs=1: these wait
    refused = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    running_ctx.__exit__(None, None, None)  # frees the slot: the first queued one runs
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_waiting") == 1)
    for context, _ in queued:
        context.__exit__(None, None, None)
    # the server notices the hang-ups asynchronously: it admits again once it has
    accepted = []
    assert wait_for(lambda: accepted.append(http.post(
        "/v1/completions", json={"prompt": "one more", "max_tokens": 2})) or
        accepted[-1].status_code == 200, timeout=10, interval=0.2)
    assert len(accepted[-1].json()["choices"]) == 1
    assert wait_for(lambda: metric(server.url, "vllm:num_requests_running") == 0
                    and metric(server.url, "vllm:kv_cache_usage_perc") == 0)


def test_sigterm_drains_in_flight_requests_then_exits(server, http):
    """Last in this module: it ends the server."""
    body = {**LONG, "max_tokens": 30}
    context, response = open_stream(http, body)
    lines = response.iter_lines()
    first = next(lines)
    server.proc.send_signal(signal.SIGTERM)
    assert wait_for(lambda: not _accepts_connections(server.url), timeout=5)
    events = [first] + [line for line in lines if line.startswith("data: ")]
    context.__exit__(None, None, None)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=20) in (0, -signal.SIGTERM)
    assert "Finished server process" in server.log()


def _accepts_connections(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=0.5)
        return True
    except httpx.TransportError:
        return False


def test_sigterm_ends_unfinished_streams_with_an_error_within_the_timeout(tiny_checkpoint,
                                                                          tmp_path):
    """Streams still open at --shutdown-timeout get an error event and [DONE] (not a cut
    connection), and the process exits within the timeout plus 2 s."""
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--max-num-seqs", "1",
                           "--shutdown-timeout", "1")
    body = {**LONG, "max_tokens": 900}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        streams = [open_stream(http, body) for _ in range(3)]  # one runs, two wait
        line_iters = [response.iter_lines() for _, response in streams]
        assert next(line_iters[0]).startswith("data: ")
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for lines in line_iters:
            events = [line for line in lines if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: "):])["error"]
            assert error["code"] == "server_shutting_down"
        for context, _ in streams:
            context.__exit__(None, None, None)
    assert server.proc.wait(timeout=10) in (0, -signal.SIGTERM)
    assert time.monotonic() - start < 1 + 2
    assert "Traceback" not in server.log()


# ---- failure containment, in-process against the real engine ----------------------------

POISON = [13, 13, 13]


class FaultyCore:
    """The real engine core, plus faults on demand: a poisoned prompt, a step that blows up,
    or a step that hangs."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.explode = threading.Event()
        self.unwedged = threading.Event()  # clear it to hang the next step
        self.unwedged.set()

    def add(self, request):
        if request.prompt_token_ids == POISON:
            raise RuntimeError("poisoned prompt")
        self.core.add(request)

    def step(self):
        if self.explode.is_set():
            raise RuntimeError("step blew up")
        self.unwedged.wait()
        return self.core.step()

    def __getattr__(self, name):
        return getattr(self.core, name)


@pytest.fixture()
def core(tiny_checkpoint):
    return FaultyCore(build_engine_core(load_config(
        model=str(tiny_checkpoint), device="cpu", dtype="float32", attention_backend="torch",
        num_kv_blocks=128)))


def start_engine(core: FaultyCore, **kwargs) -> EngineClient:
    """An EngineClient over the core in a thread (call inside the event loop)."""
    engine_client = EngineClient(CoreThread(core), Tokenizer(), 16, **kwargs)
    engine_client.start()
    return engine_client


async def _run(engine_client: EngineClient, request_id: str, prompt: list[int],
               max_tokens: int = 8) -> str:
    generation = engine_client.generate(request_id, [prompt], SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    try:
        outputs = [output async for ready in generation for _, output in ready]
        return outputs[-1].text
    finally:
        generation.close()


def _results(core, coroutines_of, observe_output=lambda o, f: None):
    async def main():
        engine_client = start_engine(core, observe_output=observe_output)
        try:
            results = await asyncio.gather(*coroutines_of(engine_client),
                                           return_exceptions=True)
            return results, engine_client
        finally:
            await engine_client.stop(timeout=10)
    return asyncio.run(main())


def test_a_failing_add_fails_only_that_request(core):
    results, _ = _results(core, lambda ae: [
        _run(ae, "good-a", [1, 2, 3]), _run(ae, "bad", POISON), _run(ae, "good-b", [4, 5])])
    assert isinstance(results[0], str) and isinstance(results[2], str)
    assert isinstance(results[1], RequestFailed) and "poisoned" in str(results[1])
    assert not core.has_unfinished()


def test_a_failing_output_handler_fails_only_that_request(core):
    def observe(output, first):
        if output.request_id.startswith("bad"):
            raise ValueError("cannot handle this output")
    results, _ = _results(core, lambda ae: [
        _run(ae, "good", [1, 2, 3]), _run(ae, "bad", [7, 8])], observe)
    assert isinstance(results[0], str)
    assert isinstance(results[1], RequestFailed) and "cannot handle" in str(results[1])
    assert not core.has_unfinished()


def test_a_dying_core_fails_requests_zeroes_the_gauges_and_exits(core):
    async def scenario():
        gauges = []
        engine_client = start_engine(core, observe_stats=lambda s: gauges.append(
            (s.num_running, s.num_waiting, s.kv_cache_usage)))
        lost = asyncio.Event()
        engine_client.on_fatal = lost.set
        pending = asyncio.create_task(_run(engine_client, "victim", [1, 2], max_tokens=500))
        await asyncio.sleep(0.2)
        core.explode.set()
        with pytest.raises(RequestFailed, match="blew up"):
            await pending
        assert not engine_client.healthy
        with pytest.raises(RequestError) as refused:
            engine_client.generate("late", [[1]], SamplingParams())
        assert refused.value.status == 503
        assert lost.is_set()  # the server exits, to be restarted
        assert gauges[-2][0] == 1 and gauges[-1] == (0, 0, 0.0)  # not left at "running 1"
        await engine_client.stop(timeout=10)
    asyncio.run(scenario())


def test_watchdog_fails_requests_of_a_wedged_core_and_stop_does_not_wait_for_it(core):
    async def scenario():
        engine_client = start_engine(core, watchdog_timeout=0.6, watchdog_exit_timeout=60)
        await asyncio.sleep(1.5)
        assert engine_client.healthy  # idle: the core still says it is alive
        core.unwedged.clear()
        stuck = asyncio.create_task(_run(engine_client, "stuck", [1, 2], max_tokens=4))
        with pytest.raises(RequestFailed) as failed:
            await asyncio.wait_for(stuck, timeout=2)
        assert failed.value.error.status == 503 and failed.value.error.code == "engine_hung"
        assert not engine_client.healthy and engine_client.silence() > 0.6
        core.unwedged.set()  # it answers again: healthy, and serving
        for _ in range(100):
            if engine_client.healthy:
                break
            await asyncio.sleep(0.02)
        assert await _run(engine_client, "after", [1, 2], max_tokens=4)
        core.unwedged.clear()
        wedged = asyncio.create_task(_run(engine_client, "wedged", [3], max_tokens=4))
        await asyncio.sleep(0.1)
        start = time.monotonic()
        await engine_client.stop(timeout=0.5)
        assert time.monotonic() - start < 1.0
        with pytest.raises(RequestFailed, match="shutting down"):
            await wedged
        core.unwedged.set()  # let the thread finish
    asyncio.run(scenario())


def test_watchdog_gives_up_on_a_core_silent_past_the_exit_timeout(core):
    async def scenario():
        engine_client = start_engine(core, watchdog_timeout=0.6, watchdog_exit_timeout=1.2)
        lost = asyncio.Event()
        engine_client.on_fatal = lost.set
        core.unwedged.clear()
        stuck = asyncio.create_task(_run(engine_client, "stuck", [1, 2], max_tokens=4))
        await asyncio.wait_for(lost.wait(), timeout=3)
        with pytest.raises(RequestFailed):
            await stuck
        with pytest.raises(RequestError) as refused:
            engine_client.generate("late", [[1]], SamplingParams())
        assert refused.value.status == 503
        core.unwedged.set()
        await engine_client.stop(timeout=10)
    asyncio.run(scenario())
