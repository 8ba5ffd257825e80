"""Send a workload from N worker processes and merge what they saw.

The parent draws the whole schedule (prompts and send times), deals it round-robin to the
workers, and starts them on one shared `time.monotonic()` instant once every worker has
imported and connected, so N workers send the same Poisson schedule one would. Each worker
reports its own CPU time, so a run shows whether the load generator kept up. HTTP goes
through aiohttp: its parser is C (vLLM's benchmark uses it too), cheaper per chunk than
pure-Python clients.

A Ctrl-C stops the run: the parent tells each worker to stop (workers ignore SIGINT, which a
terminal sends to the whole process group), and each returns the requests it has finished.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

import aiohttp
import msgspec
import uvloop
from tqdm import tqdm

from server.bench.metrics import RequestResult
from server.bench.workload import Prompt

START_SLACK_S = 0.05  # between "all workers ready" and the first send
STOP_TIMEOUT_S = 10.0  # a stopped worker answers at once; past this it is killed


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str
    api_key: str | None = None

    def session(self) -> aiohttp.ClientSession:
        """Unlimited connections, no timeout but a 30 s connect, lines (SSE events) up to
        1 MiB."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return aiohttp.ClientSession(
            self.base_url.rstrip("/") + "/",  # the requests' paths are relative to it
            headers=headers, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
            read_bufsize=1 << 20)


@dataclass(frozen=True)
class WorkerJob:
    target: Target
    prompts: list[Prompt]
    offsets: list[float]  # send times, seconds after the shared start
    max_concurrency: int | None


@dataclass
class WorkerOutcome:
    results: list[RequestResult | None]  # None: not finished when the run was stopped
    cpu_percent: float  # this process's CPU time over its wall time while sending


@dataclass
class RunOutcome:
    results: list[RequestResult]  # in schedule order; of a stopped run, the finished ones
    start: float  # the shared start instant
    cpu_percent: list[float]  # each worker's CPU use, in percent of one core
    interrupted: bool = False  # stopped by Ctrl-C before every request finished


class _Chunk(msgspec.Struct):
    """What the load generator reads of an SSE chunk (the rest is skipped, not parsed)."""
    choices: list[msgspec.Raw] = []
    usage: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def send_one(session: aiohttp.ClientSession, model: str,
                   prompt: Prompt) -> RequestResult:
    body = {"model": model, "prompt": prompt.prompt, "max_tokens": prompt.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(start=time.monotonic())
    usage = {}
    try:
        async with session.post("v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.read())[:200]
                result.error = f"HTTP {response.status}: {text!r}"
            else:
                async for line in response.content:  # one SSE line at a time, b"\n" kept
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = _decode_chunk(line[len(b"data: "):])
                    usage = chunk.usage or usage
                    if chunk.choices:
                        result.chunk_times.append(time.monotonic())
    except (aiohttp.ClientError, msgspec.DecodeError, ValueError) as exc:  # ValueError:
        result.error = f"{type(exc).__name__}: {exc}"  # a line over read_bufsize
    result.end = time.monotonic()
    fallback_prompt_len = len(prompt.prompt) if isinstance(prompt.prompt, list) else 0
    result.prompt_tokens = usage.get("prompt_tokens", fallback_prompt_len)
    result.output_tokens = usage.get("completion_tokens", len(result.chunk_times))
    if not result.error and not result.chunk_times:
        result.error = "the stream carried no output"
    return result


async def _send_all(job: WorkerJob, start: float, done_counter,
                    stop_fd: int) -> list[RequestResult | None]:
    """Every request's result; once `stop_fd` turns readable (the parent's "stop"), the
    finished ones' and None for the rest, which are cancelled. `stop_fd` ends in the blocking
    mode it came in: uvloop's add_reader makes it non-blocking, and the worker then sends its
    results down the same pipe, where a large result would raise BlockingIOError."""
    limit = asyncio.Semaphore(job.max_concurrency or len(job.prompts) or 1)
    async with job.target.session() as session:

        async def one(prompt: Prompt, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            async with limit:
                result = await send_one(session, job.target.model, prompt)
            with done_counter.get_lock():
                done_counter.value += 1
            return result

        tasks = [asyncio.ensure_future(one(p, t)) for p, t in zip(job.prompts, job.offsets)]
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        blocking = os.get_blocking(stop_fd)
        loop.add_reader(stop_fd, stop.set)
        stopped = asyncio.ensure_future(stop.wait())
        waiting = {*tasks, stopped}
        while len(waiting) > 1 and not stopped.done():
            _, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        loop.remove_reader(stop_fd)
        os.set_blocking(stop_fd, blocking)
        for task in (*tasks, stopped):
            task.cancel()  # a finished task stays finished
        await asyncio.gather(*tasks, stopped, return_exceptions=True)
        return [None if task.cancelled() else task.result() for task in tasks]


def _worker(job: WorkerJob, conn, done_counter) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the run (module doc)
    conn.send("ready")
    start = conn.recv()
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0, wall0 = time.process_time(), time.monotonic()
    # uvloop: less CPU per chunk
    results = uvloop.run(_send_all(job, start, done_counter, conn.fileno()))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    conn.send(WorkerOutcome(results, 100.0 * cpu / max(wall, 1e-9)))
    conn.close()


def run_workers(target: Target, prompts: list[Prompt], offsets: list[float], num_workers: int,
                max_concurrency: int | None, show_progress: bool) -> RunOutcome:
    """Every request's result (in schedule order), the shared start instant, and each worker's
    CPU use in percent of one core. --max-concurrency is split evenly over workers. A Ctrl-C
    while requests are out stops the workers: the outcome then holds the finished requests
    only, and says it was interrupted."""
    per_worker = math.ceil(max_concurrency / num_workers) if max_concurrency else None
    ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or event loop
    done_counter = ctx.Value("i", 0)
    workers, conns = [], []
    for w in range(num_workers):
        job = WorkerJob(target, prompts[w::num_workers], offsets[w::num_workers], per_worker)
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(job, child_end, done_counter), daemon=True)
        proc.start()
        child_end.close()  # the worker's only: its exit is then EOF here, not a hang
        workers.append(proc)
        conns.append(parent_end)
    outcomes: dict[int, WorkerOutcome] = {}
    interrupted = False
    try:
        for w, conn in enumerate(conns):
            try:
                conn.recv()  # "ready"
            except EOFError:
                raise RuntimeError(f"client worker {w} failed to start") from None
        start = time.monotonic() + START_SLACK_S
        for conn in conns:
            conn.send(start)
        try:
            _collect(conns, outcomes, len(prompts), done_counter, show_progress)
        except KeyboardInterrupt:
            interrupted = True
            _stop(conns, outcomes)
    finally:
        for proc in workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    results: list[RequestResult | None] = [None] * len(prompts)
    for w, outcome in outcomes.items():
        results[w::num_workers] = outcome.results
    finished = [r for r in results if r is not None]
    return RunOutcome(finished, start, [outcomes[w].cpu_percent for w in sorted(outcomes)],
                      interrupted and len(finished) < len(prompts))


def _collect(conns, outcomes: dict[int, WorkerOutcome], total: int, done_counter,
             show_progress: bool) -> None:
    """Fill `outcomes` (worker index -> outcome) as the workers finish."""
    with tqdm(total=total, disable=not show_progress, unit="req") as bar:
        while len(outcomes) < len(conns):
            for w, conn in enumerate(conns):
                if w not in outcomes and conn.poll(0.1):
                    try:
                        outcomes[w] = conn.recv()
                    except EOFError:
                        raise RuntimeError(f"client worker {w} exited without results") from None
            bar.update(done_counter.value - bar.n)


def _stop(conns, outcomes: dict[int, WorkerOutcome]) -> None:
    """Tell every worker still sending to stop, and take what each has finished (a worker
    that does not answer within STOP_TIMEOUT_S has none). Another Ctrl-C meanwhile is
    ignored: it must not cost the report."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for w, conn in enumerate(conns):
            if w not in outcomes:
                try:
                    conn.send("stop")
                except OSError:  # it has exited: what it sent is still in the pipe
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w, conn in enumerate(conns):
            if w not in outcomes and conn.poll(max(0.0, deadline - time.monotonic())):
                try:
                    outcomes[w] = conn.recv()
                except EOFError:
                    pass
    finally:
        signal.signal(signal.SIGINT, previous)


async def warm_up(target: Target, prompt: list[int]) -> None:
    async with target.session() as session:
        result = await send_one(session, target.model, Prompt(prompt, 4))
    if not result.ok:
        raise RuntimeError(f"warm-up request failed: {result.error}")


async def served_model(base_url: str, api_key: str | None) -> str:
    """The first model /v1/models lists."""
    async with Target(base_url, "", api_key).session() as session:
        async with session.get("v1/models", timeout=aiohttp.ClientTimeout(total=30.0),
                               raise_for_status=True) as response:
            return (await response.json())["data"][0]["id"]
