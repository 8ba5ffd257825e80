"""Injected engine faults (faulty_server.py): every stream caught in one ends with an error
event and [DONE] rather than hanging, and the server exits non-zero to be restarted: at once
when the core dies, past --watchdog-exit-timeout when one of its steps hangs."""
from __future__ import annotations

import asyncio

import pytest

from faulty_server import FAIL_PROMPT, HANG_PROMPT
from sse_client import Stream, client, ended_with_error, open_streams

FAULTY = "tests.stress.faulty_server"


def test_a_failing_step_errors_every_stream_and_the_server_exits_non_zero(launch):
    server = launch("--num-kv-blocks", "1024", "--shutdown-timeout", "3", module=FAULTY)

    async def scenario():
        async with client(server.url) as http:
            streams, tasks = await open_streams(http, 8)
            poisoned = Stream({"prompt": FAIL_PROMPT, "max_tokens": 4})
            await asyncio.wait_for(poisoned.run(http), 30)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return streams, poisoned
    streams, poisoned = asyncio.run(scenario())
    assert all(ended_with_error(s) for s in streams), [vars(s) for s in streams][:2]
    assert ended_with_error(poisoned) or poisoned.status in (500, 503), vars(poisoned)
    assert server.proc.wait(timeout=3 + 5) == 1  # a dead core: restart the server


@pytest.mark.slow
def test_a_hung_step_errors_every_stream_at_the_watchdog_and_the_server_exits_later(launch):
    server = launch("--watchdog-timeout", "1", "--watchdog-exit-timeout", "4",
                    "--shutdown-timeout", "2", "--num-kv-blocks", "1024", module=FAULTY)

    async def scenario():
        async with client(server.url) as http:
            async def unhealthy() -> bool:
                return (await http.get("/health")).status_code == 503

            streams, tasks = await open_streams(http, 4)
            assert not await unhealthy()
            hung = Stream({"prompt": HANG_PROMPT, "max_tokens": 4})
            tasks.append(asyncio.create_task(hung.run(http)))
            await asyncio.wait_for(asyncio.gather(*tasks), 1 + 5)
            assert await unhealthy()
            return streams + [hung]
    streams = asyncio.run(scenario())
    assert all(ended_with_error(s) for s in streams)
    assert server.proc.wait(timeout=4 + 10) == 1
    assert "Traceback" not in server.log()
