"""EngineCore: the scheduler, the block manager and the model runner, stepped together. It
knows sequences and token ids only (text, stop strings and n choices are engine/output's). It
runs in the caller's process (offline `LLM`) or its own (server/core_main.py).

    step():  schedule N+1 ─▶ launch N+1 ─▶ wait N ─▶ update N ─▶ StepOutput of N
    device:  ──── step N ────────────────┘└──── step N+1 ─────────────────────

With async_scheduling off, each step is applied before step() returns. A step flagged
`apply_before_next` (a request in it may speculate) is applied before the next is scheduled:
wait N ─▶ update N ─▶ schedule N+1 ─▶ launch N+1 (docs/speculative.md section 4).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, CoreRequest,
                                  EngineStats, FromCore, SequenceFailed, SequenceOutput,
                                  Shutdown, StepOutput, ToCore)
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, Speculator

log = logging.getLogger(__name__)
IDLE_WAIT = 0.2  # seconds an idle core waits for work before it says it is alive


class EngineCore:
    def __init__(self, config: EngineConfig, runner, speculator: Speculator | None = None
                 ) -> None:
        """`runner`: a ModelRunner (engine/build.py builds both) or a test's fake with its
        `num_kv_blocks` and `launch(SchedulerOutput) -> pending with .wait()`."""
        self.config = config
        self.runner = runner
        self.block_manager = BlockManager(runner.num_kv_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.speculator = speculator
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   speculator=self.speculator)
        self._in_flight = None  # (SchedulerOutput, pending result) of the launched step
        self._num_sent: dict[str, int] = {}  # seq id -> output tokens already reported

    def add(self, request: CoreRequest) -> None:
        """Queue a sequence. Raises ValueError with a clear message on bad input."""
        self.scheduler.add(Request(request.seq_id, request.prompt_token_ids, request.params,
                                   arrival_time=request.arrival_time,
                                   cache_salt=request.cache_salt,
                                   priority=request.priority))
        self._num_sent[request.seq_id] = 0

    def abort(self, seq_ids: list[str]) -> None:
        """Finish these sequences now and free their blocks. Unknown ids are ignored."""
        for seq_id in seq_ids:
            self.scheduler.finish(seq_id, RequestStatus.FINISHED_ABORTED)
            self._num_sent.pop(seq_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> StepOutput:
        outputs = []
        if self._in_flight is not None and self._in_flight[0].apply_before_next:
            outputs = self._apply(*self._in_flight)  # the next step starts where it ended
            self._in_flight = None
        scheduled = self.scheduler.schedule()
        launched = None if scheduled.is_empty else (scheduled, self.runner.launch(scheduled))
        to_finish = launched
        if self.config.scheduler.async_scheduling:
            to_finish, self._in_flight = self._in_flight, launched
        if to_finish is not None:  # never a step applied above: that left nothing in flight
            outputs = self._apply(*to_finish)
        return StepOutput(outputs, self.stats(scheduled.num_tokens))

    def _apply(self, scheduled, pending) -> list[SequenceOutput]:
        """Wait for a launched step, update the scheduler, and report what changed."""
        result = pending.wait()
        changed = self.scheduler.update(scheduled, result)
        logprobs = dict(zip(result.request_ids, result.logprobs)) if any(result.logprobs) else {}
        return [out for request in changed
                if (out := self._output_of(request, logprobs.get(request.request_id)))]

    def _output_of(self, request: Request, token_logprobs) -> SequenceOutput | None:
        """The tokens the frontend has not seen yet, or None. A final_only sequence with no
        stop strings or logprobs gets them all at its end (no per-token message)."""
        seq_id, params = request.request_id, request.params
        sent = self._num_sent.get(seq_id)
        if sent is None:
            return None  # aborted since it was scheduled
        finished = request.status.is_finished
        if (not finished and params.output_kind == "final_only" and not params.stop
                and params.logprobs is None):
            return None
        new_tokens = request.output_token_ids[sent:]
        if finished:
            del self._num_sent[seq_id]
        else:
            self._num_sent[seq_id] = request.num_output_tokens
        # a sequence with logprobs is never deferred: it reports its one token every step
        logprobs = None if params.logprobs is None else [token_logprobs]
        return SequenceOutput(seq_id, new_tokens, request.token_times[sent:], logprobs,
                              request.finish_reason, request.stop_reason, request.finish_time,
                              request.first_scheduled_time, request.num_cached_tokens)

    def stats(self, num_scheduled_tokens: int = 0) -> EngineStats:
        """The engine's state now; `num_scheduled_tokens`: of the step just scheduled."""
        bm, scheduler = self.block_manager, self.scheduler
        spec = None if self.speculator is None else self.speculator.counts()
        return EngineStats(len(scheduler.running), len(scheduler.waiting), bm.usage,
                           bm.prefix_queries, bm.prefix_hits, scheduler.num_preemptions,
                           bm.num_free_blocks, bm.num_blocks,
                           spec, num_scheduled_tokens)


def run_core_loop(core: EngineCore, receive: Callable[[float], list[ToCore]],
                  send: Callable[[FromCore], None]) -> None:
    """Apply every arrived message (`receive(timeout)` waits up to `timeout` for the first),
    step, send the StepOutput; repeat. Idle, it sends an empty StepOutput every IDLE_WAIT:
    the frontends' watchdogs time its silence. Returns on Shutdown; a failing step sends
    CoreFailed and returns. `receive` drops malformed frames."""
    try:
        while True:
            for message in receive(0.0 if core.has_unfinished() else IDLE_WAIT):
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, AbortSequences):
                    core.abort(message.seq_ids)
                else:
                    _add_all(core, message, send)
            send(core.step() if core.has_unfinished() else StepOutput([], core.stats()))
    except Exception as exc:  # the core's state is unknown now: stop
        log.exception("engine core loop died")
        send(CoreFailed(f"engine core died: {type(exc).__name__}: {exc}"))


def _add_all(core: EngineCore, message: AddSequences, send: Callable[[FromCore], None]) -> None:
    for seq in message.sequences:
        try:
            core.add(seq)
        except Exception as exc:  # fails this sequence only
            log.exception("adding sequence %s failed", seq.seq_id)
            send(SequenceFailed(seq.seq_id, f"{type(exc).__name__}: {exc}"))
