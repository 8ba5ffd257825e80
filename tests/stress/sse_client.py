"""Many completions at once from one asyncio client: what each stream received, how it
ended, and optional hang-ups after a number of events (a disconnecting client)."""
from __future__ import annotations

import asyncio
import inspect
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Stream:
    """One streaming completion; `run` fills it in, so others may watch it while it runs."""
    body: dict[str, Any]
    hang_up_after: int | None = None  # close the connection after this many events
    status: int | None = None
    events: list[str] = field(default_factory=list)  # the `data:` payloads, in order
    hung_up: bool = False  # the client left before the stream ended
    failure: Exception | None = None  # the transport broke (e.g. an incomplete chunked read)

    async def run(self, http: httpx.AsyncClient) -> Stream:
        try:
            await self._read(http)
        except httpx.TransportError as exc:
            self.failure = exc
        return self

    async def _read(self, http: httpx.AsyncClient) -> None:
        body = {**self.body, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            self.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                self.events.append(line[len("data: "):])
                if self.hang_up_after is not None and len(self.events) >= self.hang_up_after:
                    self.hung_up = not self.done
                    return

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def text(self) -> str:
        return "".join(c["choices"][0]["text"] for c in self.chunks if c.get("choices"))

    @property
    def error(self) -> dict[str, Any] | None:
        return next((c["error"] for c in self.chunks if "error" in c), None)

    @property
    def finish_reason(self) -> str | None:
        return next((c["choices"][0]["finish_reason"] for c in self.chunks
                     if c.get("choices") and c["choices"][0]["finish_reason"]), None)


def client(url: str, timeout: float = 120) -> httpx.AsyncClient:
    """No pool limit: every stream gets its own connection at once."""
    return httpx.AsyncClient(base_url=url, timeout=timeout,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


LONG = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True}  # minutes on the tiny model


async def open_streams(http: httpx.AsyncClient, count: int) -> tuple[list[Stream], list]:
    """`count` long streams, returned once every one is producing tokens, with their tasks:
    the bystanders a fault or a shutdown catches mid-stream."""
    streams = [Stream(LONG) for _ in range(count)]
    tasks = [asyncio.create_task(s.run(http)) for s in streams]
    assert await until(lambda: all(s.events for s in streams), timeout=60)
    return streams, tasks


def ended_with_error(stream: Stream) -> bool:
    """The stream was admitted, then ended with an error event and [DONE]."""
    return stream.status == 200 and stream.error is not None and stream.done


def run_streams(url: str, bodies: list[dict[str, Any]],
                hang_up_after: list[int | None] | None = None) -> list[Stream]:
    """All bodies at once, each on its own connection."""
    streams = [Stream(body, after) for body, after
               in zip(bodies, hang_up_after or [None] * len(bodies))]

    async def main() -> list[Stream]:
        async with client(url) as http:
            return await asyncio.gather(*(s.run(http) for s in streams))
    return asyncio.run(main())


def solo_texts(url: str, bodies: list[dict[str, Any]]) -> list[str]:
    """Each body streamed alone, one after another: the reference for batched runs."""
    async def main() -> list[str]:
        async with client(url) as http:
            return [(await Stream(body).run(http)).text for body in bodies]
    return asyncio.run(main())


async def until(predicate: Callable[[], Any], timeout: float) -> bool:
    """Poll `predicate` (plain or async) on the event loop until it holds or `timeout`
    seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        held = predicate()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)


async def sigterm(server: Any, tasks: list[asyncio.Task[Any]], limit: float) -> float:
    """SIGTERM the server process, wait for it to exit (giving up `limit` + 10 s later) and
    for `tasks` to end; returns the seconds it took to exit."""
    server.proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    await until(lambda: server.proc.poll() is not None, limit + 10)
    exited = time.monotonic() - start
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    return exited
