"""`--api-server-count N`: N API server processes in front of one engine core
(server/api_servers.py), and the core's routing of outputs to them (server/client_router.py)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import httpx
import msgspec
import pytest

from engine import LLM, SamplingParams
from engine.core.beam import BeamSearchParams
from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, CoreRequest,
                                  EngineStats, NewTokens, SequenceFailed, SequenceOutput,
                                  StepOutput, ToCore)
from server.client_router import ClientRouter
from server.core_main import decode_frames
from server_harness import ServerProcess, core_pid, is_running, metric, wait_for

STATS = EngineStats(1, 0, 0.5, 0, 0, 0, 10, 20)


def add(client: int, *seq_ids: str) -> AddSequences:
    params = SamplingParams(max_tokens=4)
    return AddSequences([CoreRequest(seq_id, [1, 2], params, 0.0) for seq_id in seq_ids],
                        client)


def output(seq_id: str, finished: bool = False) -> SequenceOutput:
    return SequenceOutput(seq_id, [7], [1.0], None, "length" if finished else None, None,
                          1.0 if finished else None, 0.5, 0)


def test_each_api_server_gets_its_own_outputs_and_every_step():
    router = ClientRouter(3)
    router.note(add(0, "a#0", "a#1"))
    router.note(add(2, "c#0"))
    routed = dict(router.route(StepOutput([output("a#0"), output("c#0"), output("a#1")],
                                          STATS)))
    assert [o.seq_id for o in routed[0].outputs] == ["a#0", "a#1"]
    assert routed[1].outputs == [] and routed[1].stats == STATS  # a sign of life all the same
    assert [o.seq_id for o in routed[2].outputs] == ["c#0"]


def test_new_tokens_rows_go_to_their_own_api_server():
    router = ClientRouter(2)
    router.note(add(0, "a#0"))
    router.note(add(1, "b#0", "c#0"))
    new = NewTokens(["b#0", "a#0", "c#0"], [5, 6, 7], [1.0, 2.0, 3.0])
    routed = dict(router.route(StepOutput([output("a#0")], STATS, new)))
    assert routed[0].new_tokens == NewTokens(["a#0"], [6], [2.0])
    assert routed[1].new_tokens == NewTokens(["b#0", "c#0"], [5, 7], [1.0, 3.0])
    assert [o.seq_id for o in routed[0].outputs] == ["a#0"] and routed[1].outputs == []


def test_a_beam_searchs_results_all_go_to_its_api_server():
    """The core reports a search added as '<id>#0' under '<id>#0' .. '<id>#<beam_width - 1>':
    every one goes back to the server that sent it (before, all but the first went to server
    0, and the stream on server 1 waited for them forever)."""
    router = ClientRouter(2)
    search = CoreRequest("s#0", [1, 2], SamplingParams(max_tokens=4), 0.0,
                         beam=BeamSearchParams(beam_width=3, max_tokens=4))
    router.note(AddSequences([search], 1))
    routed = dict(router.route(StepOutput([output(f"s#{rank}", finished=True)
                                           for rank in range(3)], STATS)))
    assert [o.seq_id for o in routed[1].outputs] == ["s#0", "s#1", "s#2"]
    assert routed[0].outputs == []
    router.note(AddSequences([msgspec.structs.replace(search, seq_id="t#0")], 1))
    assert client_of(router, "t#2") == 1
    router.note(AbortSequences(["t#0", "t#1", "t#2"]))  # as the API server aborts a search
    assert [client_of(router, f"t#{rank}") for rank in range(3)] == [0, 0, 0]  # forgotten


def client_of(router: ClientRouter, seq_id: str) -> int:
    """Where an output of seq_id goes now: its API server while the router remembers it, the
    default (0) once forgotten."""
    routed = router.route(StepOutput([output(seq_id)], STATS))
    return next(client for client, message in routed if message.outputs)


def test_finished_and_aborted_sequences_are_forgotten():
    router = ClientRouter(2)
    router.note(add(1, "a#0", "b#0", "c#0"))
    router.note(AbortSequences(["b#0"]))
    router.route(StepOutput([output("a#0", finished=True), output("c#0")], STATS))
    assert [client_of(router, s) for s in ("a#0", "b#0", "c#0")] == [0, 0, 1]
    assert router.route(SequenceFailed("c#0", "boom")) == [(1, SequenceFailed("c#0", "boom"))]
    assert client_of(router, "c#0") == 0


def test_a_core_failure_reaches_every_api_server():
    assert [client for client, _ in ClientRouter(3).route(CoreFailed("dead"))] == [0, 1, 2]


def test_a_sequence_from_an_unknown_api_server_is_a_bug():
    with pytest.raises(ValueError, match="client 2"):
        ClientRouter(2).note(add(2, "x#0"))


def test_malformed_frames_to_the_core_are_dropped_not_fatal(caplog):
    router, decoder = ClientRouter(2), msgspec.msgpack.Decoder(ToCore)
    good = msgspec.msgpack.encode(add(1, "a#0"))
    frames = [b"\xc1garbage", msgspec.msgpack.encode({"not": "a message"}),
              msgspec.msgpack.encode(add(7, "b#0")),  # from an API server that does not exist
              msgspec.msgpack.encode(["AddSequences", [["c#0", [1], 5, 0.0]], 0]), good]
    assert decode_frames(frames, decoder, router) == [add(1, "a#0")]
    assert client_of(router, "a#0") == 1 and client_of(router, "b#0") == 0
    assert caplog.text.count("dropped a malformed message") == 4


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "256",
                         "--api-server-count", "2")
    yield proc
    proc.stop()


def api_server_pids(server: ServerProcess) -> list[int]:
    return [int(pid) for pid in
            re.search(r"API servers \(pids ([\d ]+)\)", server.log()).group(1).split()]


async def stream_texts(url: str, prompts: list[str]) -> list[str]:
    """Each prompt in its own streaming request, all at once: connections spread over the
    API servers."""
    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        return await asyncio.gather(*(one(http, prompt) for prompt in prompts))


def test_streams_over_two_api_servers_equal_offline_generate(servers, tiny_checkpoint):
    prompts = [f"request {i}: the quick brown fox" for i in range(24)]
    offline = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                  attention_backend="torch", num_kv_blocks=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert asyncio.run(stream_texts(servers.url, prompts)) == [o.text for o in offline]
    # /metrics from whichever server answers counts both servers' requests
    assert metric(servers.url, "vllm:request_success_total", finished_reason="length") >= 24
    assert len(api_server_pids(servers)) == 2


def test_a_dead_engine_core_stops_every_api_server_with_exit_1(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--api-server-count", "2")
    pids = api_server_pids(server)
    try:
        os.kill(core_pid(server), signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1  # for the orchestrator to restart it
        assert wait_for(lambda: not any(map(is_running, pids)), timeout=10)
    finally:
        server.stop()


def test_sigterm_stops_every_process(servers_to_stop):
    server, pids = servers_to_stop
    assert server.stop() == 0
    assert wait_for(lambda: not any(map(is_running, pids)), timeout=10)


def test_a_killed_supervisor_takes_every_process_with_it(servers_to_stop):
    server, pids = servers_to_stop
    server.proc.kill()  # no handler runs: the kernel's parent-death signal does it
    server.proc.wait()
    assert wait_for(lambda: not any(map(is_running, pids)), timeout=10)


def test_an_api_server_dying_stops_the_rest(servers_to_stop):
    server, pids = servers_to_stop
    os.kill(pids[1], signal.SIGKILL)
    assert server.proc.wait(timeout=30) == 1
    assert wait_for(lambda: not any(map(is_running, pids)), timeout=10)
    assert "exited with code -9; stopping the others" in server.log()


@pytest.fixture
def servers_to_stop(tiny_checkpoint, tmp_path):
    """A fresh two-server deployment and the pids of its core and API servers."""
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--api-server-count", "2")
    yield server, [core_pid(server), *api_server_pids(server)]
    server.stop()
