"""Runs the (not thread-safe) LLMEngine in one thread and bridges it to asyncio.

    event loop ──commands (queue.Queue: add / abort / stop)────────────▶ engine thread
    event loop ◀──loop.call_soon_threadsafe(this iteration's events)────  engine thread

Only the engine thread touches the engine. It drains every pending command between steps and
blocks on the command queue when idle, so an idle server burns no CPU. Each HTTP request is a
`Generation`: one engine request per prompt, whose outputs arrive on one asyncio queue.

Failure containment: an exception while adding or delivering one request fails that request
only. An exception from `engine.step()` means the engine's state can no longer be trusted: the
loop stops, every request fails, and `healthy` turns False (/health answers 503).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.output.outputs import RequestOutput
from engine.core.request import SamplingParams
from server.protocol import RequestError

logger = logging.getLogger("gpt2serve.engine")


class RequestFailed(RuntimeError):
    """The engine failed this request, not the client: HTTP 500, or 503 while shutting down
    (`error` is the body and status the client gets)."""

    def __init__(self, message: str, status: int = 500, code: str = "internal_error") -> None:
        super().__init__(message)
        err_type = "service_unavailable" if status == 503 else "internal_server_error"
        self.error = RequestError(message, code=code, status=status, err_type=err_type)


SHUTTING_DOWN = RequestFailed("the server is shutting down", status=503,
                              code="server_shutting_down")


class ClientDisconnected(Exception):
    """The client went away; its engine requests are already aborted."""


def service_unavailable(message: str, code: str) -> RequestError:
    return RequestError(message, code=code, status=503, err_type="service_unavailable")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generation: Generation
    index: int


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class Generation:
    """One HTTP request's engine requests (one per prompt), merged in arrival order.

    All methods run on the event loop; the engine thread reaches them through
    `call_soon_threadsafe`. Iterating yields `(prompt_index, RequestOutput)`.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str], n: int) -> None:
        self._owner = owner
        self.request_ids = request_ids
        self._n = n  # sequences per engine request, each counted against the queue cap
        self._items: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._acks_pending = len(request_ids)
        self._accepted = asyncio.get_running_loop().create_future()
        self._unfinished = set(request_ids)
        self._waiting = set(request_ids)  # no output yet: counts against the queue cap
        owner.num_waiting += len(request_ids) * n
        owner.live.add(self)

    # -- called from the engine thread (via the loop) --
    def on_ack(self, index: int, error: Exception | None) -> None:
        if self._accepted.done():
            return
        if error is not None:
            self._accepted.set_exception(error)
            return
        self._acks_pending -= 1
        if self._acks_pending == 0:
            self._accepted.set_result(None)

    def on_output(self, index: int, output: RequestOutput) -> None:
        first = output.request_id in self._waiting
        self._leave_waiting(output.request_id)
        if output.error is not None:
            self.on_failure(index, output.error)
            return
        self._owner.observe_output(output, first)
        self._items.put_nowait(("output", index, output))

    def on_failure(self, index: int, failure: str | RequestFailed) -> None:
        if isinstance(failure, str):
            failure = RequestFailed(failure)
        self.on_ack(index, failure)
        self._items.put_nowait(("failure", index, failure))

    # -- called by the HTTP layer --
    async def accepted(self) -> None:
        """Wait until the engine took every prompt; raise its rejection (RequestError, 400)."""
        await self._accepted

    def cancel(self) -> None:
        """The client disconnected: abort now and wake the consumer."""
        self.close()
        self._items.put_nowait(("cancelled",))

    def close(self) -> None:
        """Abort whatever has not finished. Idempotent; the engine ignores finished ids."""
        self._owner.live.discard(self)
        for request_id in self._unfinished:
            self._owner.abort(request_id)
            self._leave_waiting(request_id)
        self._unfinished.clear()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished:
            kind, *rest = await self._items.get()
            if kind == "cancelled":
                raise ClientDisconnected()
            if kind == "failure":
                raise rest[1]
            index, output = rest
            if output.finished:
                self._unfinished.discard(output.request_id)
            yield index, output

    def _leave_waiting(self, request_id: str) -> None:
        if request_id in self._waiting:
            self._waiting.discard(request_id)
            self._owner.num_waiting -= self._n


class AsyncEngine:
    def __init__(self, engine: Any, max_queued_requests: int, watchdog_timeout: float = 60.0,
                 observe_output: Callable[[RequestOutput, bool], None] = lambda o, f: None,
                 observe_stats: Callable[[Any], None] = lambda s: None) -> None:
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.observe_output = observe_output
        self._observe_stats = observe_stats
        self.num_waiting = 0  # sequences with no output yet (event-loop side)
        self.live: set[Generation] = set()  # open generations (event-loop side)
        self.watchdog_timeout = watchdog_timeout
        # written by the engine thread: when its loop last completed an iteration, and
        # whether it is idle (blocked on the command queue, nothing to step)
        self._heartbeat = time.monotonic()
        self._idle = True
        self._stopping = threading.Event()  # checked between steps and between commands
        self.stats: Any = None  # latest engine.stats() snapshot
        self._commands: queue.Queue[Any] = queue.Queue()
        self._accepting = False
        self._lock = threading.Lock()  # makes "accepting?" and "enqueue" one step
        self._routes: dict[str, tuple[Generation, int]] = {}  # engine thread only
        self._events: list[tuple[Generation, str, int, Any]] = []  # engine thread only
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def healthy(self) -> bool:
        """Serving, and not stalled: the loop completed an iteration within the watchdog
        limit, or has nothing to do."""
        return (self._accepting and self._thread.is_alive()
                and self.step_age() <= self.watchdog_timeout)

    def step_age(self) -> float:
        """Seconds since the engine loop last completed an iteration while it had work."""
        return 0.0 if self._idle else time.monotonic() - self._heartbeat

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._accepting = True
        self._thread.start()

    async def stop(self, timeout: float) -> None:
        """Abort what is left (the HTTP server drained first) and join the thread, for at
        most `timeout` seconds: a wedged engine must not keep the process alive (the thread
        is a daemon, so the process exits without it)."""
        self._stopping.set()
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            logger.warning("the engine loop did not stop within %.1f s; exiting without it",
                           timeout)

    def fail_open(self, failure: RequestFailed) -> None:
        """End every open generation now with `failure` (the shutdown deadline passed): its
        stream sends an error event and [DONE] instead of being cut off."""
        for generation in list(self.live):
            generation.on_failure(0, failure)
            generation.close()

    def generate(self, request_id: str, prompts: list[list[int]],
                 params: SamplingParams) -> Generation:
        """Queue one engine request per prompt. A request costs P prompts x n choices
        sequences against the queue cap: 400 if it could never fit, 503 when the queue is
        too full now or the engine is dead."""
        cost, cap = len(prompts) * params.n, self.max_queued_requests
        if cost > cap:
            raise RequestError(f"this request asks for {cost} sequences ({len(prompts)} "
                               f"prompts x n={params.n}); the server queues at most {cap}",
                               param="prompt", code="too_many_sequences")
        if self.num_waiting + cost > cap:
            raise service_unavailable(
                f"the server has {self.num_waiting} sequences waiting (limit {cap}); "
                "retry shortly", code="queue_full")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        generation = Generation(self, ids, params.n)
        with self._lock:
            if not self._accepting:
                generation.close()
                raise service_unavailable("the engine is not running", code="engine_dead")
            for index, (rid, prompt) in enumerate(zip(ids, prompts)):
                self._commands.put(_Add(rid, prompt, params, generation, index))
        return generation

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            self._publish_stats()  # gauges and the log line are right before any request
            while self._apply_commands(block=not self.engine.has_unfinished_requests()):
                self._flush()  # acks go out before the step: stream headers need not wait
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._flush()
                self._publish_stats()
                self._heartbeat = time.monotonic()
            self._fail_everything(SHUTTING_DOWN)
        except Exception as exc:  # the engine's state is unknown now: stop serving
            logger.exception("engine loop died")
            self._fail_everything(RequestFailed(f"engine loop died: {type(exc).__name__}: "
                                                f"{exc}"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; False once asked to stop."""
        if self._stopping.is_set():
            return False
        try:
            self._idle = block
            command = self._commands.get(block=block)
        except queue.Empty:
            return True
        finally:
            self._heartbeat, self._idle = time.monotonic(), False
        while True:
            if command is _STOP or self._stopping.is_set():
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._routes.pop(command.request_id, None)
            self.engine.abort(command.request_id)
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids,
                                    command.params)
        except ValueError as exc:  # the engine's verdict on the input: the client's 400
            self._notify(command.generation, "on_ack", command.index,
                         RequestError(str(exc), param="prompt"))
            return
        except Exception as exc:
            logger.exception("adding request %s failed", command.request_id)
            self.engine.abort(command.request_id)
            self._notify(command.generation, "on_failure", command.index, f"add failed: {exc}")
            return
        self._routes[command.request_id] = (command.generation, command.index)
        self._notify(command.generation, "on_ack", command.index, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:  # aborted meanwhile
                continue
            if output.finished or output.error is not None:
                del self._routes[output.request_id]
            self._notify(route[0], "on_output", route[1], output)

    def _notify(self, generation: Generation, event: str, index: int, payload: Any) -> None:
        self._events.append((generation, event, index, payload))

    def _flush(self) -> None:
        """Hand this iteration's events to the loop in one wake-up, not one per request."""
        if self._events:
            events, self._events = self._events, []
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_deliver_all, events)

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()
        self._observe_stats(self.stats)

    def _fail_everything(self, failure: RequestFailed) -> None:
        with self._lock:
            self._accepting = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._routes[command.request_id] = (command.generation, command.index)
        for request_id, (generation, index) in list(self._routes.items()):
            self._safe_abort(request_id)
            self._notify(generation, "on_failure", index, failure)
        self._routes.clear()
        try:
            self._flush()
        except RuntimeError:  # the event loop is already closed: nobody is waiting
            pass

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)


def _deliver_all(events: list[tuple[Generation, str, int, Any]]) -> None:
    for event in events:
        _deliver(*event)


def _deliver(generation: Generation, event: str, index: int, payload: Any) -> None:
    """Runs on the loop: a bug while handling one request's event fails that request only."""
    try:
        getattr(generation, event)(index, payload)
    except Exception as exc:
        logger.exception("handling %s of a request failed", event)
        if event != "on_failure":
            generation.on_failure(index, f"internal error: {type(exc).__name__}: {exc}")
