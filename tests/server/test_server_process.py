"""The server as two processes: the API process and the engine core (server/engine_process.py).
What crosses between them, what each does when the other dies, and that the split changes no
output."""
from __future__ import annotations

import json
import os
import re
import signal

import httpx
import msgspec
import pytest

from engine import LLM, SamplingParams
from engine.core.batch import TokenLogprobs
from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, CoreRequest,
                                  EngineStats, FromCore, SequenceFailed, SequenceOutput,
                                  Shutdown, StepOutput, ToCore)
from server_harness import ServerProcess, core_pid, is_running, wait_for

PROMPTS = ["The quick brown fox", "Hello, my name is", "1 2 3 4"]


def test_every_message_survives_msgpack():
    params = SamplingParams(n=2, temperature=0.5, stop=("###",), logit_bias=((3, 1.5),),
                            seed=7, logprobs=2)
    to_core: list[ToCore] = [AddSequences([CoreRequest("r#0", [1, 2, 3], params, 12.5)]),
                             AbortSequences(["r#0", "r#1"]), Shutdown()]
    stats = EngineStats(1, 2, 0.25, 10, 4, 0, 30, 40)
    logprobs = TokenLogprobs(-0.5, [4, 5], [-0.5, -1.0])
    from_core: list[FromCore] = [
        StepOutput([SequenceOutput("r#0", [4, 9], [1.0, 1.1], [logprobs, None], "stop",
                                   "###", 1.2, 0.9, 16)], stats),
        SequenceFailed("r#1", "boom"), CoreFailed("dead")]
    encoder = msgspec.msgpack.Encoder()
    for union, messages in ((ToCore, to_core), (FromCore, from_core)):
        decoder = msgspec.msgpack.Decoder(union)
        for message in messages:
            assert decoder.decode(encoder.encode(message)) == message
    assert msgspec.msgpack.Decoder(ToCore).decode(encoder.encode(to_core[0])).sequences[0] \
        .params.stop_token_set == params.stop_token_set  # a real, validated SamplingParams


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    proc = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("srv") / "server.log",
                         "--served-model-name", "tiny", "--num-kv-blocks", "128")
    yield proc
    proc.stop()


def test_greedy_output_over_http_equals_offline_generate(server, tiny_checkpoint):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32",
                  attention_backend="torch", num_kv_blocks=128).generate(PROMPTS, params,
                                                                         use_tqdm=False)
    body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    choices = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
    assert [c["text"] for c in sorted(choices, key=lambda c: c["index"])] == \
        [o.text for o in offline]


def test_a_dead_engine_core_ends_streams_with_an_error_and_the_server_exits_1(tiny_checkpoint,
                                                                               tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--max-num-seqs", "1")
    body = {"prompt": "go on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as running, \
                    http.stream("POST", "/v1/completions", json=body) as queued:
                running_lines = running.iter_lines()
                assert next(running_lines).startswith("data: ")
                os.kill(core_pid(server), signal.SIGKILL)
                for lines in (running_lines, queued.iter_lines()):
                    events = [line for line in lines if line.startswith("data: ")]
                    assert events[-1] == "data: [DONE]"
                    assert "exited unexpectedly" in json.loads(events[-2][6:])["error"]["message"]
        assert server.proc.wait(timeout=40) == 1  # for the orchestrator to restart it
    finally:
        server.stop()


def test_the_engine_core_dies_with_the_server(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log")
    pid = core_pid(server)
    assert is_running(pid)
    server.proc.kill()  # no shutdown handler runs
    server.proc.wait()
    assert wait_for(lambda: not is_running(pid), timeout=10)


def test_the_engine_core_logs_its_startup_phases_beside_the_server(server):
    """The spawned core configures its own logging: without it, its lines (and a crash's
    traceback) would go nowhere."""
    log = server.log()
    assert re.search(r"engine\.worker\.model_runner: loaded .* in \d+\.\d s", log)
    assert re.search(r"KV cache: 128 blocks .* sized in \d+\.\d s", log)
    assert re.search(r"ready in \d+\.\d s: process start \d+\.\d s, load \d+\.\d s, KV "
                     r"sizing \d+\.\d s \(given\)", log)
