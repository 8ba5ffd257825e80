"""EngineClient: the server's side of the engine. It owns the output processor (text, stop
strings, the n choices), so per-token Python work stays off the engine core's loop, and it
talks to the core through a `CoreConnection`: a process of its own (server/engine_process.py,
what `gpt2-serve` runs) or a thread (tests/core_thread.py, for tests).

    HTTP request ──generate()──▶ OutputProcessor.add ──AddSequences──▶ core
    Generation ◀──RequestOutputs── OutputProcessor.process ◀──StepOutput── core (one per step)
                                   └──AbortSequences (stop strings, disconnects)──▶ core

Everything here runs on the event loop. Failure containment: a failure while handling one
request's output fails that request only. The core speaks after every step, and every 0.2 s
when idle, so its silence is the watchdog's measure, whatever the clients do: past
`watchdog_timeout` every open request fails with a 503 and /health answers 503; a dead core
(CoreFailed, or its process gone), or one silent past `watchdog_exit_timeout`, fails every
request and calls `on_fatal`, with which the server exits non-zero to be restarted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import msgspec

from engine.beam_search import BeamSearchParams, beam_search_requests
from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, EngineStats,
                                  FromCore, SequenceFailed, StepOutput, ToCore)
from engine.core.request import SamplingParams
from engine.core.scheduler import check_fits
from engine.output.outputs import RequestOutput
from engine.output.processor import OutputProcessor
from engine.output.tokenizer import Tokenizer
from server.protocol import RequestError

logger = logging.getLogger("gpt2serve.engine")


class CoreConnection(Protocol):
    """How the frontend reaches an engine core loop (engine.core.engine_core.run_core_loop)."""
    max_model_len: int
    pool_tokens: int  # tokens the core's KV pool holds: no request may need more
    block_size: int  # tokens per KV block, and the most sequences a step runs: a beam
    max_num_seqs: int  # search's admission check (engine/core/beam.py check_search_fits)
    client_index: int  # which of the core's API servers this is (0 with one)

    def start(self, deliver: Callable[[FromCore], None]) -> None:
        """Start receiving; `deliver` is called on the running event loop, in order."""

    def send(self, message: ToCore) -> None: ...

    def is_alive(self) -> bool: ...

    async def stop(self, timeout: float) -> None:
        """Ask the core to shut down; wait at most `timeout` seconds for it."""


class RequestFailed(RuntimeError):
    """The engine failed this request, not the client: HTTP 500, or 503 while shutting down
    (`error` is the body and status the client gets)."""

    def __init__(self, message: str, status: int = 500, code: str = "internal_error") -> None:
        super().__init__(message)
        self.error = server_error(message, code, status)


def shutting_down() -> RequestFailed:
    """A fresh one each time: one exception object raised in many tasks would share (and
    grow) one traceback."""
    return RequestFailed("the server is shutting down", status=503, code="server_shutting_down")


class ClientDisconnected(Exception):
    """The client went away; its engine requests are already aborted."""


def server_error(message: str, code: str, status: int = 500) -> RequestError:
    """The server's side failed, not the client's input: 503 while it may pass, else 500."""
    err_type = "service_unavailable" if status == 503 else "internal_server_error"
    return RequestError(message, code=code, status=status, err_type=err_type)


Ready = list[tuple[int, RequestOutput]]  # (prompt index, output), oldest first


class Generation:
    """One HTTP request's engine requests (one per prompt). Iterating yields, each time, every
    (prompt_index, RequestOutput) that is ready: a consumer that falls behind catches up in
    one go instead of one output at a time. The consumer waits on a bare future, set by the
    first output that arrives while it waits (an asyncio.Event costs several Python calls
    per wakeup, and a wakeup happens per streamed chunk)."""

    def __init__(self, owner: EngineClient, request_ids: list[str], n: int) -> None:
        self._owner = owner
        self._n = n  # sequences per engine request, each counted against the queue cap
        self._ready: Ready = []
        self._waiter: asyncio.Future[None] | None = None  # pending while the consumer waits
        self._end: BaseException | None = None  # a failure, or ClientDisconnected
        self._unfinished = set(request_ids)  # no finished output delivered yet
        self._waiting = set(request_ids)  # no output yet: counts against the queue cap
        owner.num_waiting += len(request_ids) * n

    def on_output(self, index: int, output: RequestOutput) -> None:
        first = output.request_id in self._waiting
        if first:
            self._leave_waiting(output.request_id)
        if output.error is not None:
            self.on_failure(RequestFailed(output.error))
            return
        self._owner.observe_output(output, first)
        self._ready.append((index, output))
        if output.finished:
            self._unfinished.discard(output.request_id)
        self._wake()

    def on_failure(self, failure: RequestFailed) -> None:
        if self._end is None:
            self._end = failure
        self._wake()

    def cancel(self) -> None:
        """The client disconnected: abort now and wake the consumer."""
        self._end = ClientDisconnected()
        self.close()
        self._wake()

    def close(self) -> None:
        """Abort whatever has not finished. Idempotent; the core ignores finished ids."""
        for request_id in self._unfinished:
            self._owner.abort(request_id)
            self._leave_waiting(request_id)
        self._unfinished.clear()

    def __aiter__(self) -> AsyncIterator[Ready]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Ready]:
        """Until every request finished: what is ready, then the failure if one came (also
        one that came before the consumer started: it must not read as a clean end)."""
        while True:
            if not self._ready and self._end is None and self._unfinished:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            ready, self._ready = self._ready, []
            if ready:
                yield ready
            if self._end is not None:
                raise self._end
            if not self._unfinished and not self._ready:
                return

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _leave_waiting(self, request_id: str) -> None:
        if request_id in self._waiting:
            self._waiting.discard(request_id)
            self._owner.num_waiting -= self._n


class EngineClient:
    def __init__(self, connection: CoreConnection, tokenizer: Tokenizer,
                 max_queued_requests: int, watchdog_timeout: float = 60.0,
                 watchdog_exit_timeout: float | None = None,
                 observe_output: Callable[[RequestOutput, bool], None] = lambda o, f: None,
                 observe_stats: Callable[[EngineStats], None] = lambda s: None,
                 observe_request: Callable[[SamplingParams], None] = lambda p: None,
                 flush_observations: Callable[[], None] = lambda: None) -> None:
        """`watchdog_timeout`: seconds of the core's silence after which open requests fail
        and /health says 503; `watchdog_exit_timeout` (default twice that): after which the
        core counts as lost for good and `on_fatal` is called. `flush_observations` runs
        after each batch of steps is handled: the observers may hold values until then."""
        self.connection = connection
        self.processor = OutputProcessor(tokenizer)
        self.max_queued_requests = max_queued_requests
        self.watchdog_timeout = watchdog_timeout
        self.watchdog_exit_timeout = watchdog_exit_timeout or 2 * watchdog_timeout
        self.observe_output = observe_output
        self._observe_stats = observe_stats
        self._observe_request = observe_request  # once per admitted prompt
        self._flush_observations = flush_observations
        # called once when the core is dead, or silent past watchdog_exit_timeout: the server
        # exits non-zero so that its supervisor (Kubernetes, Docker, systemd) restarts it
        self.on_fatal: Callable[[], None] = lambda: None
        self.num_waiting = 0  # sequences with no output yet
        self.stats: EngineStats | None = None  # the core's state after its latest step
        self._routes: dict[str, tuple[Generation, int]] = {}  # engine request id -> owner
        self._steps: list[StepOutput] = []  # delivered, applied once the batch is in
        self._accepting = False
        self._last_heard = time.monotonic()  # the core's latest message
        self._silent = False  # the watchdog has tripped and the core has not spoken since
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        """Serving, and the core alive and heard from within the watchdog limit."""
        return (self._accepting and self.connection.is_alive()
                and self.silence() <= self.watchdog_timeout)

    def silence(self) -> float:
        """Seconds since the core's latest message. A live core sends one per step, and one
        every engine_core.IDLE_WAIT when idle, so this grows only when it is stuck."""
        return time.monotonic() - self._last_heard

    def start(self) -> None:
        self._last_heard = time.monotonic()
        self.connection.start(self._deliver)
        self._accepting = True
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self, timeout: float) -> None:
        """Stop the core (the HTTP server drained first), waiting at most `timeout` seconds:
        a wedged core must not keep the process alive."""
        self._accepting = False
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.connection.stop(timeout)
        self.fail_open(shutting_down)

    def generate(self, request_id: str, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams],
                 cache_salt: str | None = None, priority: int = 0,
                 beam: list[BeamSearchParams] | None = None) -> Generation:
        """Queue one engine request per prompt, costing P prompts x n sequences against the
        queue cap: 400 if it could never fit or the engine cannot take the input, 503 when
        the queue is full now or the engine is down. Transactional: counted and routed only
        once its message is sent; if anything fails before, nothing of it remains. `params`:
        every prompt's, or one each (the same n). `beam`: each prompt's beam search, whose
        results are its n choices (engine/beam_search.py)."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        self.check_admission(prompts, each)
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        arrival = time.monotonic()
        try:
            sequences = [sequence for rid, prompt, own in zip(ids, prompts, each)
                         for sequence in self.processor.add(rid, None, prompt, own, arrival,
                                                            cache_salt=cache_salt,
                                                            priority=priority)]
            if beam is not None:
                sequences = beam_search_requests(sequences, beam)
            self.connection.send(AddSequences(sequences, self.connection.client_index))
        except Exception as exc:
            for rid in ids:
                self.processor.abort(rid)
            if isinstance(exc, (OverflowError, TypeError, ValueError)):  # msgpack refused it
                raise RequestError(f"the request holds a value the engine cannot take: "
                                   f"{exc}", code="invalid_value") from None
            raise
        generation = Generation(self, ids, each[0].n)
        for index, (rid, own) in enumerate(zip(ids, each)):
            self._routes[rid] = (generation, index)
            self._observe_request(own)
        return generation

    def check_admission(self, prompts: list[list[int]], each: list[SamplingParams]) -> None:
        """generate()'s checks before queueing anything; raises RequestError (400 or 503)."""
        n = each[0].n
        cost, cap = len(prompts) * n, self.max_queued_requests
        if cost > cap:
            raise RequestError(f"this request asks for {cost} sequences ({len(prompts)} "
                               f"prompts x n={n}); the server queues at most {cap}",
                               param="prompt", code="too_many_sequences")
        if self.num_waiting + cost > cap:
            raise server_error(
                f"the server has {self.num_waiting} sequences waiting (limit {cap}, "
                "--max-queued-requests); retry shortly", "queue_full", 503)
        if not self.healthy:
            raise server_error("the engine is not running", "engine_dead", 503)
        for prompt, params in zip(prompts, each):
            try:
                check_fits(len(prompt), params.max_tokens, self.connection.max_model_len,
                           self.connection.pool_tokens)
            except ValueError as exc:
                raise RequestError(str(exc), param="max_tokens",
                                   code="context_length_exceeded") from None

    def abort(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        seq_ids = self.processor.abort(request_id)
        if seq_ids:
            self.connection.send(AbortSequences(seq_ids))

    def fail_open(self, failure: Callable[[], RequestFailed]) -> None:
        """End every open request now with a `failure()` each (a dead or hung core, or the
        shutdown deadline passed): a stream sends an error event and [DONE] instead of
        being cut off."""
        generations = {generation for generation, _ in self._routes.values()}
        for generation in generations:
            generation.on_failure(failure())
            generation.close()

    async def _watch(self) -> None:
        """Trip at watchdog_timeout of silence (fail every open request, /health 503, a log
        line), recover if the core speaks again, give up at watchdog_exit_timeout."""
        period = min(1.0, self.watchdog_timeout / 4)  # a trip is seen within a quarter
        while True:
            await asyncio.sleep(period)
            silence = self.silence()
            if silence > self.watchdog_exit_timeout:
                logger.critical("watchdog: the engine core has not answered for %.1f s "
                                "(--watchdog-exit-timeout %.1f s); exiting so that the server "
                                "is restarted", silence, self.watchdog_exit_timeout)
                self._lose_core()
                return
            if silence > self.watchdog_timeout and not self._silent:
                self._silent = True
                logger.error("watchdog: the engine core has not answered for %.1f s "
                             "(--watchdog-timeout); failing %d open requests, /health says "
                             "503", silence, len(self._routes))
                self.fail_open(lambda: RequestFailed(
                    "the engine core is not responding", 503, "engine_hung"))

    def _lose_core(self) -> None:
        """The core is dead or hung for good: refuse new work, zero the gauges, and have
        the server exit."""
        self._accepting = False
        if self.stats is not None:  # the cumulative counters stay as they were
            self._observe_stats(msgspec.structs.replace(
                self.stats, num_running=0, num_waiting=0, kv_cache_usage=0.0,
                num_scheduled_tokens=0))
        self.on_fatal()

    # ---- messages from the core, on the event loop ----
    def _deliver(self, message: FromCore) -> None:
        """Steps delivered together are applied together, once the batch is in: one output
        per request for all of them. Any other message applies the steps before it first."""
        self._last_heard = time.monotonic()
        if self._silent:
            self._silent = False
            logger.warning("watchdog: the engine core answers again")
        if isinstance(message, StepOutput):
            if not self._steps:
                asyncio.get_running_loop().call_soon(self._on_steps)
            self._steps.append(message)
            return
        self._on_steps()
        if isinstance(message, SequenceFailed):
            self._fail_request(message.seq_id.rsplit("#", 1)[0], message.message)
        elif isinstance(message, CoreFailed):
            logger.error("%s; failing %d open requests and exiting", message.message,
                         len(self._routes))
            self.fail_open(lambda: RequestFailed(message.message))
            self._lose_core()

    def _on_steps(self) -> None:
        steps, self._steps = self._steps, []
        if not steps:
            return
        self.stats = steps[-1].stats
        for step in steps:  # each: a step's scheduled tokens are in its own stats only
            self._observe_stats(step.stats)
        outputs, to_abort = self.processor.process(*steps)
        if to_abort:
            self.connection.send(AbortSequences(to_abort))
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            if output.finished:
                del self._routes[output.request_id]
            try:
                route[0].on_output(route[1], output)
            except Exception as exc:  # a bug handling one request fails that request only
                logger.exception("handling the output of %s failed", output.request_id)
                self._fail_request(output.request_id,
                                   f"internal error: {type(exc).__name__}: {exc}")
        self._flush_observations()

    def _fail_request(self, request_id: str, message: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            route[0].on_failure(RequestFailed(message))
            route[0].close()

