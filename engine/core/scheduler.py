"""Continuous batching with one token budget per step. Pure Python.

Each step, `schedule()`:
  1. gives running requests, in order, their next tokens (a decode token or the next prompt
     chunk). When blocks run out, the last running request is preempted: blocks freed,
     requeued, recomputed later from prompt + output so far.
  2. admits waiting requests in queue order while budget, sequence slots and blocks allow,
     each after its longest cached prefix (from the start if it needs prompt logprobs).

Queue order is the policy: fcfs (arrival; a preempted request goes back to the front) or
priority ((priority, arrival_time), lower first). `running` keeps the same order, so its last
request is preempted first.

`update()` applies sampled tokens and checks EOS, stop token ids, max_tokens and the context
length; the engine finishes stop strings through `finish()`. A request with max_tokens 0
samples nothing and ends with its prompt; `num_prompt_logprobs_done` keeps a recompute from
reporting a prompt position twice.

Steps may be scheduled one ahead: a request whose next token step N samples gets a
PLACEHOLDER_TOKEN in step N+1 (`prev_sample_row`: its row in N's samples), only if that token
cannot end it by length, no penalty needs it, and it may not speculate; if the token ends it
anyway, update drops N+1's work for it. A request that may speculate waits instead, and
`apply_before_next` tells EngineCore to apply N before scheduling N+1. Drafts and lookahead
blocks: docs/speculative.md, 3, 4, 8. Running requests that decode ahead (the steady decode
step; the leading ones, when a later one does not) are scheduled by `_decode_ahead_rows` and
applied by update (`_apply_ahead`) without the general loop's checks per row; when they are
the whole step and its rows are the step before's, or what remains of them, the step is sent
as what changed (SchedulerOutput.continued).

A beam search (engine/core/beam.py) runs its live beams as requests whose sampled token is
ignored: update hands each beam's logprobs to its group, and once every live beam has
reported, extends, forks and ends beams (`_take_beam_step`). Its steps are applied before
the next is scheduled, and beams are never preempted (their search's admission reserved
their blocks and slots).
"""
from __future__ import annotations

import bisect
import operator
import time
from typing import Protocol

from engine.core.batch import (PLACEHOLDER_TOKEN, DecodeContinuation, PromptLogprobsJob,
                               RunnerOutput, ScheduledSequence, SchedulerOutput)
from engine.core.beam import BeamGroup, check_search_fits, reserved_blocks
from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.messages import SpecCounts
from engine.core.request import Request, RequestStatus
from engine.core.waiting import PriorityWaitingQueue, WaitingQueue, priority_key


class Speculator(Protocol):
    """The scheduler's view of speculative decoding (engine/speculative/speculator.py)."""
    lookahead: int  # positions past a verification whose blocks a speculating request keeps

    def begin_step(self, batch_size: int) -> int: ...  # this step's draft length (0: none)

    def may_speculate(self, request: Request) -> bool: ...

    def propose(self, request: Request, max_drafts: int) -> list[int]: ...

    def observe(self, num_drafts: int, num_accepted: int) -> None: ...

    def release(self, request_id: str) -> None: ...

    def counts(self) -> SpecCounts: ...  # the cumulative counters, for the step's stats


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int,
               pool_tokens: int) -> None:
    """The one rule a request must meet to be scheduled at all (the server checks it before
    sending); raises ValueError saying why not."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt is empty: it must hold at least one token")
    need = num_prompt_tokens + max_tokens
    if need > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {need} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or completion.")
    if need > pool_tokens:
        raise ValueError(f"this request needs {need} tokens of KV cache; the whole pool holds "
                         f"{pool_tokens}")


_request_id = operator.attrgetter("request_id")


class _StepDraft:
    """The step schedule() is building, row by row."""
    __slots__ = ("now", "sequences", "requests", "sample_rows", "num_tokens", "num_drafts",
                 "apply_first", "prompt_logprobs", "ahead", "continued")

    def __init__(self, now: float) -> None:
        self.now = now
        self.sequences: list[ScheduledSequence] = []
        self.ahead: list[Request] = []  # its first rows' requests, if _decode_ahead_rows'
        self.requests: dict[str, Request] = {}  # by id: update applies to these very requests
        self.sample_rows: dict[str, int] = {}  # request id -> its row in the step's samples
        self.num_tokens = 0
        self.num_drafts = 0
        self.apply_first = False  # a sampling request may speculate
        self.prompt_logprobs = False  # some sequence has a PromptLogprobsJob
        self.continued: DecodeContinuation | None = None  # its rows, sent as what changed


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock=time.monotonic, speculator: Speculator | None = None):
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting = PriorityWaitingQueue() if self.by_priority else WaitingQueue()
        self.running: list[Request] = []  # admission order, or priority_key order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.speculator = speculator
        self._step: _StepDraft | None = None  # the step schedule() is building
        self._step_id = 0
        self._step_requests: dict[int, dict[str, Request]] = {}  # step id -> requests, until update
        self._step_ahead: dict[int, list[Request]] = {}  # step id -> _decode_ahead_rows'
        self._sample_rows: dict[str, int] = {}  # request id -> its row in the last step's samples
        # the last step's rows (requests, by identity), if _decode_ahead_rows' were the whole
        # of it
        self._run: list[Request] | None = None
        self.beam_searches: dict[str, BeamGroup] = {}  # by group id, until they end
        self.finished_beam_searches: list[BeamGroup] = []  # ended, for EngineCore to report
        self._beam_of: dict[str, BeamGroup] = {}  # live beam id -> its group; empty: no search
        self._beam_reserved = [0, 0]  # blocks and sequences reserved by admitted searches
        self._block_copies: list[tuple[int, int]] = []  # forks' copies, for the next step

    # ------------------------------------------------------------------ intake
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_fits(len(request.prompt_token_ids), request.params.max_tokens,
                   self.config.max_model_len, self.block_manager.num_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, status: RequestStatus,
               stop_reason: int | str | None = None) -> None:
        """End a request (abort, or a stop string found by the engine) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            if request_id in self.beam_searches:  # a beam search: all of its live beams
                self._end_beam_search(self.beam_searches[request_id], status)
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)  # by identity: at most max_num_seqs entries
            if not self.running:  # no run left to continue: hold no ended request
                self._run = None
        else:  # waiting, or preempted back into the queue
            self.waiting.remove(request_id)
        request.status = status
        request.stop_reason = stop_reason
        request.finish_time = self.clock()
        self.block_manager.free(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_invariants(self) -> None:
        """Assert every request is running or waiting, never both, with the matching status,
        and both queues are in the policy's order."""
        running_ids = [r.request_id for r in self.running]
        waiting = list(self.waiting)
        assert len(set(running_ids)) == len(running_ids), "a request runs twice"
        assert set(running_ids) | {r.request_id for r in waiting} == set(self.requests)
        assert len(running_ids) + len(waiting) == len(self.requests), "running and waiting"
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                   for r in waiting)
        assert len(self.running) <= self.config.max_num_seqs
        assert all(r.max_num_tokens <= self.config.max_model_len for r in self.requests.values())
        if self.by_priority:
            keys = [priority_key(r) for r in self.running]
            assert keys == sorted(keys), "running is out of priority order"
            keys = [priority_key(r) for r in waiting]
            assert keys == sorted(keys), "waiting is out of priority order"
            assert not waiting or self.waiting.first() is waiting[0]
        live = [b for group in self.beam_searches.values() for b in group.live]
        assert {b.request_id for b in live} == set(self._beam_of), "live beams"
        assert all(b.status is RequestStatus.RUNNING or b is self._beam_of[b.request_id].root
                   for b in live), "a beam waits"
        reserved = [g.reserved for g in self.beam_searches.values() if g.reserved is not None]
        assert self._beam_reserved == [sum(r[0] for r in reserved), sum(r[1] for r in reserved)]

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._step = _StepDraft(self.clock())
        preempted: list[str] = []
        if self.speculator is not None:
            self.speculator.begin_step(len(self.running))
        budget = self._schedule_running(budget, preempted)
        if not preempted:  # memory is tight: let running requests drain first
            self._admit_waiting(budget)
        step, self._step = self._step, None
        copies = ()
        if self._beam_of or self._block_copies:  # a beam search runs
            step.apply_first |= any(rid in self._beam_of for rid in step.sample_rows)
            if step.sequences:
                copies, self._block_copies = tuple(self._block_copies), []
        self._sample_rows = step.sample_rows
        self._step_id += 1
        if step.sequences or step.continued:
            self._step_requests[self._step_id] = step.requests
        if step.ahead:
            self._step_ahead[self._step_id] = step.ahead
        self._note_run(step)
        return SchedulerOutput(sequences=step.sequences, preempted_ids=preempted,
                               step_id=self._step_id, num_draft_tokens=step.num_drafts,
                               apply_before_next=step.apply_first,
                               has_prompt_logprobs=step.prompt_logprobs,
                               num_tokens=step.num_tokens, block_copies=copies,
                               continued=step.continued)

    def _note_run(self, step: _StepDraft) -> None:
        """Keep the step's rows for the next step to continue (_decode_ahead_rows), if they
        were _decode_ahead_rows' alone."""
        whole = step.continued is not None or (step.ahead
                                               and len(step.sequences) == len(step.ahead))
        self._run = step.ahead if whole else None

    def _add_to_step(self, request: Request, start: int, num_new: int,
                     drafts: list[int]) -> None:
        """Describe the request's work from position `start` (its computed and pending
        tokens) in the step being built, and mark it pending. Called in row order; a request
        is never preempted once added (victims come from the tail)."""
        step, request_id = self._step, request.request_id
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
        seq = self._describe(request, start, num_new, drafts)
        step.num_drafts += len(drafts)
        step.prompt_logprobs |= seq.prompt_logprobs is not None
        request.num_pending_tokens += num_new
        step.num_tokens += num_new
        if seq.sample:
            request.num_pending_samples += 1
            step.sample_rows[request_id] = len(step.sample_rows)
            if self.speculator is not None and self.speculator.may_speculate(request):
                step.apply_first = True
        step.sequences.append(seq)
        step.requests[request_id] = request

    def _add_decode_ahead(self, requests: list[Request]) -> None:
        """_add_to_step for requests decoding ahead of the step in flight (each at start ==
        num_tokens): a request's one new token is that step's sample, a placeholder, and it
        samples the next. One loop for a list, since a steady decode step adds every running
        request here (_decode_ahead_rows)."""
        step, block_ids, last_rows = self._step, self.block_manager.block_ids, self._sample_rows
        sequences, sample_rows, step_requests = step.sequences, step.sample_rows, step.requests
        row = len(sample_rows)
        for request in requests:
            request_id = request.request_id
            sequences.append(ScheduledSequence(
                request_id, [PLACEHOLDER_TOKEN], request.num_tokens, block_ids(request_id),
                True, request.params, (), (), request.num_output_tokens + 1,
                last_rows[request_id]))
            request.num_pending_tokens += 1
            request.num_pending_samples += 1
            sample_rows[request_id] = row
            step_requests[request_id] = request
            row += 1
        step.num_tokens += len(requests)

    def _may_run_ahead(self, request: Request) -> bool:
        """Its pending token cannot end it by length, this step need not read it (penalties,
        bad words), and it would not rather wait and speculate (never then: it decodes ahead
        without drafts)."""
        return (request.num_tokens + request.num_pending_samples < request.max_num_tokens
                and not request.params.needs_output_tokens
                and not (self.speculator and self.speculator.may_speculate(request)))

    def _decode_ahead_rows(self) -> int:
        """The steady decode step's rows, without the general loop's checks per row: running
        requests, from the first, whose next token is in flight and that may decode ahead of
        it (no speculator, no beam search) each get their placeholder row, as _schedule_running
        would give them one row at a time; returns how many leading requests of `running` it
        took, and the loop takes the rest (a prompt still being prefilled, say). A request
        whose token in flight is its last gets no row (it ends when that token is applied), as
        in the loop. Blocks are asked for only where a row starts one; if one cannot be had,
        nothing is scheduled and 0 leaves the step to the loop, which preempts for it (the rows
        grown here keep their blocks: growing is idempotent, and the loop grows the same rows
        in the same order). Rows that are the whole step and continue the step before's are
        sent as a DecodeContinuation (_continue_run)."""
        running, block_manager = self.running, self.block_manager
        if self.speculator is not None or self._beam_of or not running:
            return 0
        ending, starting_a_block, block_size = [], [], block_manager.block_size
        taken = len(running)
        for row, request in enumerate(running):
            computed = request.num_computed_tokens + request.num_pending_tokens
            if not (request.num_pending_samples and computed == request.num_tokens
                    and not request.params.needs_output_tokens):
                taken = row
                break
            if computed + 1 >= request.max_num_tokens:
                ending.append(row)  # its token in flight is its last: it waits, as in the loop
            elif not computed % block_size:
                starting_a_block.append(row)
        rows = running[:taken]
        if ending:  # rows renumbered without them
            for row in reversed(ending):
                del rows[row]
            starting_a_block = [row - bisect.bisect(ending, row) for row in starting_a_block]
        grow = block_manager.grow
        if not rows or not all(grow(rows[row].request_id, rows[row].num_tokens + 1)
                               for row in starting_a_block):
            return 0
        src = self._rows_continued(rows) if taken == len(running) else False
        if src is False:
            self._add_decode_ahead(rows)
        else:
            block_ids = block_manager.block_ids
            self._continue_run(rows, src, [(row, block_ids(rows[row].request_id)[-1])
                                           for row in starting_a_block])
        self._step.ahead = rows
        return taken

    def _rows_continued(self, rows: list[Request]) -> tuple[int, ...] | None | bool:
        """The rows of the step before that `rows` continue, in order: None if all of them;
        False if some row continues none, or a request may be admitted after them. `rows`
        are what remains of the run's rows: between two schedules requests only end (in
        update, or by abort), and none is admitted before _decode_ahead_rows."""
        run = self._run
        if run is None or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return False
        if rows == run:
            return None
        src = tuple(map(self._sample_rows.get, map(_request_id, rows)))
        return False if None in src else src

    def _continue_run(self, rows: list[Request], src: tuple[int, ...] | None,
                      new_blocks: list[tuple[int, int]]) -> None:
        """_add_decode_ahead for `rows`, which continue rows `src` of the step before (None:
        all of them), sent as what changed (DecodeContinuation): only `new_blocks` are new,
        and the rows of the step before are reused where every one continues (its requests
        by id are still kept for its update: a continued run's rows decode ahead of it)."""
        step = self._step
        for request in rows:
            request.num_pending_tokens += 1
            request.num_pending_samples += 1
        if src is None:
            step.requests = self._step_requests[self._step_id]
            step.sample_rows = self._sample_rows
            request_ids = list(self._sample_rows)
        else:
            request_ids = list(map(_request_id, rows))
            step.requests = dict(zip(request_ids, rows))
            step.sample_rows = dict(zip(request_ids, range(len(rows))))
        step.num_tokens += len(rows)
        step.continued = DecodeContinuation(request_ids, tuple(new_blocks), src)

    def _schedule_running(self, budget: int, preempted: list[str]) -> int:
        """Victims come from the tail of `running`, never before i, so no request scheduled
        here is preempted afterwards."""
        i = self._decode_ahead_rows() if len(self.running) <= budget else 0
        budget -= len(self._step.ahead)
        running, block_size = self.running, self.block_manager.block_size
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens + request.num_pending_tokens
            if request.num_pending_samples and computed == request.num_tokens:
                # its next token is in flight: one placeholder, if it may decode ahead; a
                # block holds position computed - 1 already, so a new one only at a boundary
                if self._may_run_ahead(request) and (
                        computed % block_size or self._grow(i, request, computed + 1, [],
                                                            preempted)):
                    self._add_decode_ahead([request])
                    budget -= 1
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_pending_samples - computed, budget)
            if num_new <= 0 or (request.num_pending_samples
                                and not self._may_run_ahead(request)):
                i += 1
                continue
            drafts = [] if self.speculator is None else self._drafts(request, computed,
                                                                     num_new, budget)
            num_new += len(drafts)
            total = computed + num_new
            # a block holds position computed - 1 already: a new one only past its end
            if ((drafts or (total - 1) // block_size != (computed - 1) // block_size)
                    and not self._grow(i, request, total, drafts, preempted)):
                i += 1
                continue
            self._add_to_step(request, computed, num_new, drafts)
            budget -= num_new
            i += 1
        return budget

    def _grow(self, i: int, request: Request, total: int, drafts: list[int],
              preempted: list[str]) -> bool:
        """Make running[i]'s table cover `total` tokens (and a speculating request's
        lookahead where blocks are free: no request is preempted for it), preempting from the
        tail as needed. False if it does not run this step: it is a beam with only beams
        after it (it waits a step), or it was the victim."""
        ahead = self._with_lookahead(total) if drafts else total
        grow, request_id = self.block_manager.grow, request.request_id
        while not (ahead > total and grow(request_id, ahead) or grow(request_id, total)):
            victim = self._victim(i)
            if victim is None:
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _with_lookahead(self, num_tokens: int) -> int:
        """A speculating request's table covers the speculator's lookahead past its tokens."""
        return min(num_tokens + self.speculator.lookahead, self.config.max_model_len)

    def _drafts(self, request: Request, computed: int, num_new: int, budget: int) -> list[int]:
        """Drafts for a request decoding its last known token, if it may speculate."""
        speculator = self.speculator
        if (num_new != 1 or computed + 1 != request.num_tokens
                or not speculator.may_speculate(request)):
            return []
        return speculator.propose(request, budget - 1)

    def _admit_waiting(self, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.first()
            if self._beam_of and not self._may_admit_beams(request):
                break
            tokens = request.all_token_ids
            cached = [] if request.needs_prompt_logprobs else \
                self.block_manager.find_cached_prefix(tokens, request.cache_salt)
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(len(tokens) - num_cached, budget)
            if not self.block_manager.admit(request.request_id, tokens, cached, num_new,
                                            request.cache_salt):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self._add_running(request)
            self._add_to_step(request, num_cached, num_new, [])
            budget -= num_new

    def _add_running(self, request: Request) -> None:
        """Keep `running` in the policy's order: its last request is preempted first."""
        if self.by_priority:
            bisect.insort_right(self.running, request, key=priority_key)
        else:
            self.running.append(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = request.num_pending_samples = 0  # their results are dropped
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _describe(self, request: Request, start: int, num_new: int,
                  drafts: list[int]) -> ScheduledSequence:
        """Work on known tokens from `start` (nothing pending): a prompt chunk, a decode
        token, or a decode token and its drafts."""
        end = start + num_new - len(drafts)  # the known tokens end here
        num_tokens = request.num_tokens
        token_ids = request.tokens_between(start, end) + drafts
        block_ids = self.block_manager.block_ids(request.request_id)
        sample = end == num_tokens + request.num_pending_samples
        params = request.params
        output_ids = tuple(request.output_token_ids) if params.needs_output_tokens else ()
        prompt_ids = tuple(request.prompt_token_ids) if params.needs_penalties else ()
        num_output = request.num_output_tokens + request.num_pending_samples
        job = None
        if params.prompt_logprobs is not None:
            job = self._prompt_logprobs_job(request, start, end)
            sample = sample and params.max_tokens > 0  # max_tokens 0: the prompt alone
        # positional: keywords cost more on this per-sequence hot path
        return ScheduledSequence(request.request_id, token_ids, start, block_ids, sample, params,
                                 output_ids, prompt_ids, num_output, -1, len(drafts), job)

    @staticmethod
    def _prompt_logprobs_job(request: Request, start: int, end: int) -> PromptLogprobsJob | None:
        """The prompt positions in [start, end) whose logprobs are still to be reported: those
        with a prompt token after them, past the ones reported already (a recompute after a
        preemption reports nothing twice). Chunks still in flight report up to `start`, unless
        preempted, when their results are dropped."""
        prompt = request.prompt_token_ids
        first = max(start, request.num_prompt_logprobs_done)
        stop = min(end, len(prompt) - 1)
        if first >= stop:
            return None
        return PromptLogprobsJob(first - start, tuple(prompt[first + 1:stop + 1]),
                                 request.params.prompt_logprobs)

    # ----------------------------------------------------------------- update
    def applies_token(self, step_id: int, request_id: str) -> bool:
        """Whether update() of step `step_id` (not yet applied) will append the request's
        sampled token: the very request scheduled there still runs."""
        request = self._step_requests.get(step_id, {}).get(request_id)
        return request is not None and request.status is RequestStatus.RUNNING

    def update(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply one step's results. Returns requests that got a new token, prompt logprobs
        (the step's RunnerOutput has them) or finished."""
        now = self.clock()
        sampled = dict(zip(output.request_ids, output.sampled_token_ids))
        requests = self._step_requests.pop(scheduled.step_id, {})
        accepted = (dict(zip(output.request_ids, output.accepted_drafts))
                    if scheduled.num_draft_tokens else {})
        changed, reports, beams = [], [], self._beam_of
        ahead = self._step_ahead.pop(scheduled.step_id, ())
        if ahead:
            self._apply_ahead(ahead, output.sampled_token_ids, now, changed)
        for seq in scheduled.sequences[len(ahead):]:
            request_id = seq.request_id
            request = requests[request_id]  # the very request scheduled (ids may be reused)
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or preempted since it was scheduled
            num_new = len(seq.token_ids)
            request.num_pending_tokens -= num_new
            request.num_pending_samples -= seq.sample
            if seq.num_drafts or seq.prompt_logprobs is not None or not seq.sample:
                if self._apply_described(request, seq, sampled, accepted, now):
                    changed.append(request)
                continue
            if beams and request_id in beams:  # its group picks its token
                self._computed(request, num_new)
                reports.append(request)
                continue
            # one sampled token after known or placeholder tokens: the decode fast path
            self._computed(request, num_new)
            self._append(request, sampled[request_id], now)
            changed.append(request)
        if reports:
            self._report_beams(reports, output, now)
        return changed

    def _apply_ahead(self, ahead: list[Request], tokens: list[int], now: float,
                     changed: list[Request]) -> None:
        """update() for a step's first rows, those _decode_ahead_rows scheduled (its first
        samples, in order): update's one-token decode path (_computed, then _append) without
        its checks per row, and inlined, calling out only past a block boundary, at a stop
        token or at the length bound. A row's token is never its first (the step before
        sampled one, applied by now), so first_token_time is set. Held to the general path
        by tests/core/test_decode_all_ahead.py."""
        block_size, running = self.block_manager.block_size, RequestStatus.RUNNING
        for request, token in zip(ahead, tokens):
            if request.status is not running:
                continue  # finished or preempted since it was scheduled
            request.num_pending_tokens -= 1
            request.num_pending_samples -= 1
            request.num_computed_tokens += 1
            if not request.num_computed_tokens % block_size:
                self._cache_full_blocks(request)  # a block boundary passed
            request.output_token_ids.append(token)  # Request.append_output_token's work
            request.num_output_tokens += 1
            request.num_tokens += 1
            request.token_times.append(now)
            if token in request.params.stop_token_set or (
                    request.num_tokens >= request.max_num_tokens):
                self._check_stop(request, token)
            changed.append(request)

    def _apply_described(self, request: Request, seq: ScheduledSequence,
                         sampled: dict[str, int], accepted: dict[str, list[int]],
                         now: float) -> bool:
        """Apply a sequence with drafts, prompt logprobs or no sample (a prompt chunk); True
        if the caller must report the request."""
        num_new = len(seq.token_ids)
        if seq.num_drafts:
            self._apply_verified(request, seq, accepted[seq.request_id],
                                 sampled[seq.request_id], now)
            return True
        self._computed(request, num_new)
        job = seq.prompt_logprobs
        if job is not None:
            request.num_prompt_logprobs_done = (seq.start_position + job.first_row
                                                + len(job.target_ids))
        token = sampled.get(seq.request_id)
        if token is not None:
            self._append(request, token, now)
        elif request.params.max_tokens == 0 and request.num_computed_tokens == len(
                request.prompt_token_ids):  # the whole prompt, and nothing to generate
            self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)
        elif job is None:
            return False  # a prompt chunk that did not reach the end
        return True

    def _computed(self, request: Request, num_new: int) -> None:
        """num_new more tokens have KV; blocks they filled join the prefix cache."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens % self.block_manager.block_size < num_new:
            self._cache_full_blocks(request)  # a block boundary passed

    def _append(self, request: Request, token: int, now: float) -> None:
        request.append_output_token(token)
        request.token_times.append(now)
        if request.first_token_time is None:
            request.first_token_time = now
        if token in request.params.stop_token_set or (
                request.num_tokens >= request.max_num_tokens):  # else it cannot end here
            self._check_stop(request, token)

    def _apply_verified(self, request: Request, seq: ScheduledSequence, accepted: list[int],
                        token: int, now: float) -> None:
        """Append the accepted drafts and the sampled token up to the first that ends the
        request; then release the blocks past its computed tokens (and lookahead)."""
        self.speculator.observe(seq.num_drafts, len(accepted))
        gained = len(seq.token_ids) - seq.num_drafts + len(accepted)
        request.num_computed_tokens += gained
        for new_token in accepted + [token]:
            self._append(request, new_token, now)
            if request.status is not RequestStatus.RUNNING:
                return  # finished: its blocks are freed, later tokens dropped
        if request.num_computed_tokens % self.block_manager.block_size < gained:
            self._cache_full_blocks(request)  # after the appends: a block's tokens are known
        self.block_manager.shrink(request.request_id,
                                  self._with_lookahead(request.num_computed_tokens))

    def _cache_full_blocks(self, request: Request) -> None:
        """Call only past a block boundary."""
        self.block_manager.cache_full_blocks(request.request_id, request.all_token_ids,
                                             request.num_computed_tokens)

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.params
        if token in params.stop_token_set and request.num_output_tokens >= params.min_tokens:
            return self.finish(request.request_id, RequestStatus.FINISHED_STOPPED, token)
        if request.num_tokens >= request.max_num_tokens:  # max_tokens out (or max_model_len)
            self.finish(request.request_id, RequestStatus.FINISHED_LENGTH)

    # ------------------------------------------------------------ beam search
    def add_beam_search(self, group: BeamGroup) -> None:
        """Queue a beam search: its prompt, as its first beam. ValueError if its id is in use
        or it could never run: a beam too long (check_fits), or more blocks or sequences
        reserved than the pool or max_num_seqs hold."""
        if group.group_id in self.beam_searches or group.group_id in self.requests:
            raise ValueError(f"request id {group.group_id!r} is already in use")
        prompt, params = group.root.prompt_token_ids, group.search.params
        check_fits(len(prompt), params.max_tokens, self.config.max_model_len,
                   self.block_manager.num_tokens)
        check_search_fits(len(prompt), params, self.block_manager.block_size,
                          self.block_manager.num_blocks, self.config.max_num_seqs)
        self.add(group.root)
        self.beam_searches[group.group_id] = group
        self._beam_of[group.root.request_id] = group

    def _may_admit_beams(self, request: Request) -> bool:
        """Whether the head of the queue may be admitted: a search's first beam only once the
        blocks and sequences its search may hold fit beside those reserved by the searches
        admitted before it; it reserves them then."""
        group = self._beam_of.get(request.request_id)
        if group is None or group.reserved is not None:
            return True
        params = group.search.params
        need = (reserved_blocks(len(request.prompt_token_ids), params,
                                self.block_manager.block_size), params.beam_width)
        blocks, sequences = self._beam_reserved
        if (blocks + need[0] > self.block_manager.num_blocks
                or sequences + need[1] > self.config.max_num_seqs):
            return False
        group.reserved = need
        self._beam_reserved = [blocks + need[0], sequences + need[1]]
        return True

    def _victim(self, i: int) -> Request | None:
        """Whom to preempt for running[i]'s blocks: the last running request from i on that
        is not a beam; None if running[i] is a beam and only beams follow it."""
        if not self._beam_of:
            return self.running[-1]
        return next((r for r in reversed(self.running[i:]) if r.request_id not in self._beam_of),
                    None)

    def _report_beams(self, beams: list[Request], output: RunnerOutput, now: float) -> None:
        """Hand each beam's logprobs to its group; a group whose live beams have all reported
        takes its step."""
        logprobs = dict(zip(output.request_ids, output.logprobs))
        for beam in beams:
            group = self._beam_of[beam.request_id]
            if group.report(beam.request_id, logprobs[beam.request_id]):
                self._take_beam_step(group, now)

    def _take_beam_step(self, group: BeamGroup, now: float) -> None:
        """Apply the group's choice: each new live beam continues its parent in place (the
        parent's first child) or as a fork of it, then takes its token. Parents without a
        child end first, so that their blocks and slots serve the forks. A search left without
        live beams has ended: it waits in finished_beam_searches to be reported."""
        choice = group.advance(now)  # (parent index, token), best first
        parents, continued = group.live, {index for index, _ in choice}
        for index, parent in enumerate(parents):
            if index not in continued:
                del self._beam_of[parent.request_id]
                self.finish(parent.request_id, RequestStatus.FINISHED_STOPPED)
        live, taken = [], set()
        for index, _ in choice:
            live.append(self._fork(parents[index], group) if index in taken else parents[index])
            taken.add(index)
        for beam, (_, token) in zip(live, choice):
            beam.append_output_token(token)
        group.live = live
        if not live:
            self._end_beam_search(group, RequestStatus.FINISHED_STOPPED)
            self.finished_beam_searches.append(group)

    def _fork(self, parent: Request, group: BeamGroup) -> Request:
        """A new running beam right after `parent`: a copy of it that shares its blocks
        (BlockManager.fork; the copy of a partial last block goes with the next step).
        Ordinary requests are preempted, last first, until a block and a slot are free for it:
        the search's reservation leaves one once they are gone."""
        child = Request(group.new_beam_id(), parent.prompt_token_ids, parent.params,
                        arrival_time=parent.arrival_time, cache_salt=parent.cache_salt,
                        priority=parent.priority, status=RequestStatus.RUNNING,
                        output_token_ids=list(parent.output_token_ids))
        child.num_computed_tokens = parent.num_computed_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        while True:
            if len(self.running) < self.config.max_num_seqs:
                copies = self.block_manager.fork(parent.request_id, child.request_id,
                                                 child.num_computed_tokens)
                if copies is not None:
                    break
            victim = self._victim(0)
            assert victim is not None, "a beam search's reservation was not kept"
            self._preempt(victim)
        self._block_copies += copies
        self.requests[child.request_id] = child
        self._beam_of[child.request_id] = group
        self.running.insert(self.running.index(parent) + 1, child)
        return child

    def _end_beam_search(self, group: BeamGroup, status: RequestStatus) -> None:
        """End the search's live beams with `status` and release its reservation."""
        for beam in group.live:
            del self._beam_of[beam.request_id]
            self.finish(beam.request_id, status)
        group.live = []
        del self.beam_searches[group.group_id]
        if group.reserved is not None:
            blocks, sequences = self._beam_reserved
            self._beam_reserved = [blocks - group.reserved[0], sequences - group.reserved[1]]
        group.finish_time = self.clock()
