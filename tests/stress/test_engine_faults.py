"""Injected engine faults (faulty_server.py): every stream caught in one ends with an error
event and [DONE] rather than hanging, and /health turns 503."""
from __future__ import annotations

import asyncio

import httpx

from faulty_server import FAIL_PROMPT, HANG_PROMPT
from sse_client import Stream, client, sigterm, until

FAULTY = "tests.stress.faulty_server"
LONG = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True}


async def start_bystanders(http: httpx.AsyncClient, count: int):
    """Long streams that are producing tokens when the fault hits."""
    streams = [Stream(LONG) for _ in range(count)]
    tasks = [asyncio.create_task(s.run(http)) for s in streams]
    assert await until(lambda: all(s.events for s in streams), timeout=60)
    return streams, tasks


def ended_with_error(stream: Stream) -> bool:
    return stream.status == 200 and stream.error is not None and stream.done


def test_a_failing_step_errors_every_stream_turns_health_503_and_sigterm_exits(launch):
    server = launch("--num-kv-blocks", "1024", "--shutdown-timeout", "3", module=FAULTY)

    async def scenario():
        async with client(server.url) as http:
            streams, tasks = await start_bystanders(http, 8)
            poisoned = Stream({"prompt": FAIL_PROMPT, "max_tokens": 4})
            await asyncio.wait_for(poisoned.run(http), 30)
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
            health = (await http.get("/health")).status_code
            late = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        return streams, poisoned, health, late.status_code, await sigterm(server, [], 3 + 2)
    streams, poisoned, health, late, seconds_to_exit = asyncio.run(scenario())
    assert all(ended_with_error(s) for s in streams), [vars(s) for s in streams][:2]
    assert ended_with_error(poisoned) or poisoned.status == 500, vars(poisoned)
    assert health == 503 and late == 503
    assert seconds_to_exit <= 3 + 2  # a dead engine core must not hold up the shutdown


def test_a_hung_step_trips_the_watchdog_and_sigterm_still_ends_every_stream(launch):
    server = launch("--watchdog-timeout", "1", "--shutdown-timeout", "2",
                    "--num-kv-blocks", "1024", module=FAULTY)

    async def scenario():
        async with client(server.url) as http:
            async def unhealthy() -> bool:
                return (await http.get("/health")).status_code == 503

            streams, tasks = await start_bystanders(http, 4)
            assert not await unhealthy()
            hung = Stream({"prompt": HANG_PROMPT, "max_tokens": 4})
            tasks.append(asyncio.create_task(hung.run(http)))
            assert await until(lambda: hung.status == 200, timeout=10)
            assert await until(unhealthy, timeout=1 + 5)
            return await sigterm(server, tasks, limit=2 + 2), streams + [hung]
    seconds_to_exit, streams = asyncio.run(scenario())
    assert seconds_to_exit <= 2 + 2
    assert all(ended_with_error(s) for s in streams)
    assert "Traceback" not in server.log()
