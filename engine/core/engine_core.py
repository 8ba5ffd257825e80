"""EngineCore: the scheduler, the block manager and the model runner, stepped together. It
knows sequences and token ids only (text, stop strings and n choices are engine/output's). It
runs in the caller's process (offline `LLM`) or its own (server/core_main.py).

    step():  schedule N+1 ─▶ launch N+1 ─▶ wait N ─▶ update N ─▶ StepOutput of N
    device:  ──── step N ────────────────┘└──── step N+1 ─────────────────────

With async_scheduling off, each step is applied before step() returns. A step flagged
`apply_before_next` (a request in it may speculate) is applied before the next is scheduled:
wait N ─▶ update N ─▶ schedule N+1 ─▶ launch N+1 (docs/speculative.md section 4).

A step with structured-output rows samples late: its forward is launched, the grammars take
step N's tokens as soon as they arrive, its mask is requested, and it samples just before the
next launch, so the mask fills while the core updates and hands over step N and schedules N+2:
schedule N+1 ─▶ launch N+1's forward ─▶ wait N ─▶ request mask N+1 ─▶ update N ─▶ ...
─▶ schedule N+2 ─▶ take mask, sample N+1 ─▶ launch N+2. A constraint that completes ends its
sequence when the mask after its last token is taken. A constrained sequence waits outside
the scheduler until its grammar has compiled.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from engine.core.batch import GrammarMask, PromptLogprobs
from engine.core.beam import BeamGroup
from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, CoreRequest,
                                  EngineStats, FromCore, NewTokens, SequenceFailed,
                                  SequenceOutput, Shutdown, StepOutput, ToCore)
from engine.core.request import EOS_TOKEN_ID, Request, RequestStatus, StructuredOutputsParams
from engine.core.scheduler import Scheduler, Speculator, check_fits

log = logging.getLogger(__name__)
IDLE_WAIT = 0.2  # seconds an idle core waits for work before it says it is alive
COMPILE_WAIT = 0.005  # seconds a core with nothing but compiling grammars waits per step


class Grammars(Protocol):
    """Structured outputs as the core uses them (engine/structured/)."""

    def submit(self, seq_id: str, spec: StructuredOutputsParams) -> None: ...

    # (seq id, None: ready | an error message) for each compile that ended
    def take_compiled(self, timeout: float = 0.0) -> list[tuple[str, str | None]]: ...

    # each sequence's one new output token (a step's constrained rows)
    def advance(self, seq_ids: list[str], tokens: list[int]) -> None: ...

    def request_mask(self, rows: list[str]) -> None: ...  # the constrained rows, in order

    # the mask requested, and the sequences whose constraint completed since the last one
    def take_mask(self) -> tuple[GrammarMask, list[str]]: ...

    def release(self, seq_id: str) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, runner, speculator: Speculator | None = None,
                 grammars: Grammars | None = None) -> None:
        """`runner`: a ModelRunner (engine/build.py builds both) or a test's fake with its
        `num_kv_blocks` and `launch(SchedulerOutput) -> pending with .wait()` (and, for
        structured outputs, `.needs_mask` and `.sample(GrammarMask)`). Without `grammars`
        a structured-output request is refused."""
        self.config = config
        self.runner = runner
        self.block_manager = BlockManager(runner.num_kv_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.speculator = speculator
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   speculator=self.speculator)
        self.grammars = grammars
        self._compiling: dict[str, Request] = {}  # waiting for their grammar
        self._constrained: set[str] = set()  # seq ids with a live matcher
        self._completed: list[Request] = []  # ended by their grammar, to be reported
        self.failed: list[SequenceFailed] = []  # sequences ended by the core, to be reported
        self._in_flight = None  # (SchedulerOutput, pending result) of the launched step
        # step id -> its constrained rows, as (index in the runner's output, seq id)
        self._mask_rows: dict[int, list[tuple[int, str]]] = {}
        self._num_sent: dict[str, int] = {}  # seq id -> output tokens already reported

    def add(self, request: CoreRequest) -> None:
        """Queue a sequence, or a beam search. Raises ValueError with a clear message on bad
        input."""
        if request.beam is not None:
            self.scheduler.add_beam_search(BeamGroup(
                request.seq_id, request.prompt_token_ids, request.beam, request.arrival_time,
                request.cache_salt, request.priority))
            return
        seq = Request(request.seq_id, request.prompt_token_ids, request.params,
                      arrival_time=request.arrival_time, cache_salt=request.cache_salt,
                      priority=request.priority)
        spec = request.params.structured_outputs
        if spec is None:
            self.scheduler.add(seq)
        else:
            self._add_constrained(seq, spec)
        self._num_sent[request.seq_id] = 0

    def _add_constrained(self, request: Request, spec: StructuredOutputsParams) -> None:
        if self.grammars is None:
            raise ValueError("this engine was built without structured outputs")
        if request.request_id in self._num_sent:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_fits(len(request.prompt_token_ids), request.params.max_tokens,
                   self.config.scheduler.max_model_len, self.block_manager.num_tokens)
        self.grammars.submit(request.request_id, spec)
        self._compiling[request.request_id] = request

    def abort(self, seq_ids: list[str]) -> None:
        """Finish these sequences now and free their blocks. Unknown ids are ignored."""
        for seq_id in seq_ids:
            self.scheduler.finish(seq_id, RequestStatus.FINISHED_ABORTED)
            self._num_sent.pop(seq_id, None)
            if self.grammars is not None and self._compiling.pop(seq_id, None) is not None:
                self.grammars.release(seq_id)
            elif self.grammars is not None:
                self._release_grammar(seq_id)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or bool(self._compiling))

    def step(self) -> StepOutput:
        outputs, new_tokens = [], None
        if self._in_flight is not None and self._in_flight[0].apply_before_next:
            outputs, new_tokens = self._apply(*self._in_flight)  # the next step starts there
            self._in_flight = None
        if self._compiling:
            self._admit_compiled()
        scheduled = self.scheduler.schedule()
        if self._in_flight is not None:  # its placeholders' tokens: sampled before the launch
            self._sample_masked(self._in_flight[1])
        launched = None if scheduled.is_empty else (scheduled, self.runner.launch(scheduled))
        if self.config.scheduler.async_scheduling:
            previous, self._in_flight = self._in_flight, launched
            if previous is not None:  # never a step applied above: that left nothing in flight
                outputs, new_tokens = self._apply(*previous, launched)
            else:
                self._request_mask(launched)
        elif launched is not None:
            self._request_mask(launched)
            outputs, new_tokens = self._apply(*launched)
        return StepOutput(outputs, self.stats(scheduled.num_tokens), new_tokens)

    def _admit_compiled(self) -> None:
        """Constrained sequences whose grammar is ready join the scheduler; a core with
        nothing else to do waits a little for one, instead of spinning."""
        idle = not self.scheduler.has_unfinished() and self._in_flight is None
        for seq_id, error in self.grammars.take_compiled(COMPILE_WAIT if idle else 0.0):
            request = self._compiling.pop(seq_id, None)
            if request is None:
                continue
            if error is None:
                self.scheduler.add(request)
                self._constrained.add(seq_id)
            else:
                del self._num_sent[seq_id]
                self.failed.append(SequenceFailed(seq_id, f"structured outputs: {error}"))

    def _request_mask(self, launched) -> None:
        """A launched step with constrained rows asks for their mask: every step before it
        has been applied, so the grammars have taken every token before its rows'. The
        pending step names those rows (`constrained_rows`: their indices among its sampled
        rows), so the work here grows with them, not with the batch."""
        if launched is not None and getattr(launched[1], "needs_mask", False):
            pending = launched[1]
            rows = [(i, pending.request_ids[i]) for i in pending.constrained_rows]
            self._mask_rows[launched[0].step_id] = rows
            self.grammars.request_mask([seq_id for _, seq_id in rows])

    def _sample_masked(self, pending) -> None:
        """A step waiting for its mask samples under it; the constraints completed by then
        end their sequences (their tokens in this step are dropped)."""
        if not getattr(pending, "needs_mask", False):
            return
        mask, completed = self.grammars.take_mask()
        for seq_id in completed:
            request = self.scheduler.requests.get(seq_id)
            if seq_id not in self._constrained or request is None:
                continue  # it ended otherwise since its matcher took its last token
            self.scheduler.finish(seq_id, RequestStatus.FINISHED_STOPPED,
                                  request.output_token_ids[-1])
            self._completed.append(request)
            self._release_grammar(seq_id)
        pending.sample(mask)

    def _apply(self, scheduled, pending, launched=None
               ) -> tuple[list[SequenceOutput], NewTokens | None]:
        """Wait for a launched step, update the scheduler, and report what changed (and the
        sequences their grammar ended since the last step was applied, and the results of the
        beam searches it ended): the plain rows as NewTokens, the others as SequenceOutputs.
        `launched`: the step launched after it, whose mask is asked for as soon as the
        grammars have this step's tokens, before the update, so that it fills meanwhile."""
        self._sample_masked(pending)
        result = pending.wait()
        mask_rows = self._mask_rows.pop(scheduled.step_id, None)
        if mask_rows:
            self._advance_sampled(scheduled.step_id, mask_rows, result)
        self._request_mask(launched)
        changed = self.scheduler.update(scheduled, result)
        if self._constrained:  # constrained sequences are running
            self._release_finished_grammars()
        if self._completed:
            changed += self._completed
            self._completed = []
        logprobs = dict(zip(result.request_ids, result.logprobs)) if any(result.logprobs) else {}
        prompt_logprobs = result.prompt_logprobs  # a changed request's are applied ones
        outputs, new = [], NewTokens([], [], [])
        num_sent = self._num_sent
        for request in changed:
            params, finished = request.params, request.status.is_finished
            if params.defers_outputs and not finished and not prompt_logprobs:
                continue  # its tokens go out at its end (the offline path's every row)
            seq_id = request.request_id
            sent = num_sent.get(seq_id)
            if (sent and sent + 1 == request.num_output_tokens and params.logprobs is None
                    and not params.defers_outputs and not finished
                    and seq_id not in prompt_logprobs):  # a plain row (NewTokens)
                num_sent[seq_id] = sent + 1
                new.seq_ids.append(seq_id)
                new.token_ids.append(request.output_token_ids[-1])
                new.token_times.append(request.token_times[-1])
            elif out := self._output_of(request, logprobs.get(seq_id),
                                        prompt_logprobs.get(seq_id)):
                outputs.append(out)
        if self.scheduler.finished_beam_searches:
            outputs += self._beam_search_results()
        return outputs, new if new.seq_ids else None

    def _beam_search_results(self) -> list[SequenceOutput]:
        """Each ended beam search's results, best first, as whole sequences (a final EOS
        included, with its logprobs); the group is forgotten."""
        outputs = []
        for group in self.scheduler.finished_beam_searches:
            root = group.root
            for rank, hypothesis in enumerate(group.search.result()):
                tokens = list(hypothesis.tokens)
                eos = EOS_TOKEN_ID if hypothesis.ended_by_eos else None
                outputs.append(SequenceOutput(
                    group.result_id(rank), tokens, group.step_times[:len(tokens)],
                    list(hypothesis.logprobs), "stop" if eos is not None else "length", eos,
                    group.finish_time, root.first_scheduled_time, root.num_cached_tokens))
        self.scheduler.finished_beam_searches.clear()
        return outputs

    def _advance_sampled(self, step_id: int, rows: list[tuple[int, str]], result) -> None:
        """The matchers take the step's tokens that its update will append, before it runs:
        every token a constrained request gains (it never has drafts: one token a row), read
        at the `rows` its mask was asked for."""
        constrained, applies = self._constrained, self.scheduler.applies_token
        sampled = result.sampled_token_ids
        taken = [(seq_id, sampled[row]) for row, seq_id in rows
                 if seq_id in constrained and applies(step_id, seq_id)]
        if taken:
            seq_ids, tokens = zip(*taken)
            self.grammars.advance(list(seq_ids), list(tokens))

    def _release_finished_grammars(self) -> None:
        """Release the matchers of constrained sequences that have ended (the scheduler
        forgets a request as it finishes)."""
        for seq_id in [s for s in self._constrained if s not in self.scheduler.requests]:
            self._release_grammar(seq_id)

    def _release_grammar(self, seq_id: str) -> None:
        if seq_id in self._constrained:
            self._constrained.remove(seq_id)
            self.grammars.release(seq_id)

    def _output_of(self, request: Request, token_logprobs,
                   prompt_logprobs: PromptLogprobs | None = None) -> SequenceOutput | None:
        """The tokens the frontend has not seen yet and this step's prompt logprobs, or None.
        A sequence that `defers_outputs` gets its tokens all at its end (no per-token
        message); prompt logprobs are never held back: the core keeps none."""
        seq_id, params = request.request_id, request.params
        sent = self._num_sent.get(seq_id)
        if sent is None:
            return None  # aborted since it was scheduled
        finished = request.status.is_finished
        if not finished and params.defers_outputs and prompt_logprobs is None:
            return None
        new_tokens = request.output_token_ids[sent:]
        if finished:
            del self._num_sent[seq_id]
        else:
            self._num_sent[seq_id] = request.num_output_tokens
        # a sequence with logprobs is never deferred: it reports its one token every step
        logprobs = None if params.logprobs is None else [token_logprobs] if new_tokens else []
        return SequenceOutput(seq_id, new_tokens, request.token_times[sent:], logprobs,
                              request.finish_reason, request.stop_reason, request.finish_time,
                              request.first_scheduled_time, request.num_cached_tokens,
                              prompt_logprobs)

    def stats(self, num_scheduled_tokens: int = 0) -> EngineStats:
        """The engine's state now; `num_scheduled_tokens`: of the step just scheduled."""
        bm, scheduler = self.block_manager, self.scheduler
        spec = None if self.speculator is None else self.speculator.counts()
        return EngineStats(len(scheduler.running), len(scheduler.waiting) + len(self._compiling),
                           bm.usage,
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
            while core.failed:
                send(core.failed.pop())
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
