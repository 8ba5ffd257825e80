"""A hung or dead engine core is handled, not just reported: open streams end with an error
event and [DONE] within the watchdog limit plus 5 s, every API server's /health says 503,
and the server exits non-zero (at once for a dead core, past --watchdog-exit-timeout for a
hung one), so that Kubernetes or Docker restarts it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import pytest

from server_harness import core_pid, wait_for
from sse_client import client, ended_with_error, open_streams

WATCHDOG = 2


def health(url: str) -> int:
    """On a fresh connection: with several API servers, any of them may answer."""
    try:
        return httpx.get(url + "/health", headers={"Connection": "close"}, timeout=5).status_code
    except httpx.TransportError:
        return 0  # gone


def test_a_stopped_core_fails_every_stream_then_recovers_when_it_continues(launch):
    server = launch("--watchdog-timeout", str(WATCHDOG), "--watchdog-exit-timeout", "60",
                    "--num-kv-blocks", "1024")
    pid = core_pid(server)

    async def scenario():
        async with client(server.url) as http:
            streams, tasks = await open_streams(http, 10)
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*tasks), WATCHDOG + 5)
            ended = time.monotonic() - start
            late = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            return streams, ended, late.status_code
    try:
        streams, ended, late = asyncio.run(scenario())
        assert health(server.url) == 503 and late == 503
    finally:
        os.kill(pid, signal.SIGCONT)
    assert all(ended_with_error(s) for s in streams), [s.events[-2:] for s in streams]
    assert all(s.error["code"] == "engine_hung" for s in streams)
    assert WATCHDOG - 0.5 < ended < WATCHDOG + 5
    assert "watchdog: the engine core has not answered" in server.log()
    assert wait_for(lambda: health(server.url) == 200, timeout=5)
    again = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       timeout=30)
    assert again.status_code == 200


def test_a_core_hung_past_the_exit_timeout_makes_the_server_exit_non_zero(launch):
    server = launch("--watchdog-timeout", "1", "--watchdog-exit-timeout", "3",
                    "--shutdown-timeout", "2")
    os.kill(core_pid(server), signal.SIGSTOP)
    assert server.proc.wait(timeout=3 + 2 + 10) == 1
    assert "exiting so that the server is restarted" in server.log()


def test_a_killed_core_ends_every_stream_and_the_server_exits_non_zero(launch):
    server = launch("--num-kv-blocks", "1024", "--shutdown-timeout", "2")

    async def scenario():
        async with client(server.url) as http:
            streams, tasks = await open_streams(http, 10)
            os.kill(core_pid(server), signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return streams
    streams = asyncio.run(scenario())
    assert all(ended_with_error(s) for s in streams)
    assert server.proc.wait(timeout=15) == 1
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_with_two_api_servers_a_stopped_core_turns_both_unhealthy_then_exits(launch):
    server = launch("--api-server-count", "2", "--watchdog-timeout", str(WATCHDOG),
                    "--watchdog-exit-timeout", "6", "--shutdown-timeout", "2")
    pid = core_pid(server)
    assert all(health(server.url) == 200 for _ in range(8))
    os.kill(pid, signal.SIGSTOP)
    try:  # both servers have no work of their own: they notice the silence all the same
        assert wait_for(lambda: all(health(server.url) in (0, 503) for _ in range(8)),
                        timeout=WATCHDOG + 3)
        assert server.proc.wait(timeout=6 + 15) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):  # the supervisor kills a hung core
            os.kill(pid, signal.SIGCONT)
