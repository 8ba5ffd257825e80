"""OutputProcessor: from the engine core's token ids to what callers see. It owns a request's
n choices (sequence "{id}#{i}" is choice i), their text (incremental detokenizing, stop
strings) and their timings, and builds one RequestOutput per request that changed in a step.

    StepOutputs ──▶ process() ──▶ RequestOutputs, one per request that changed
                        └──▶ sequences a stop string ended: the caller aborts them in the core

It runs beside the core (offline `LLM`) or in the API server's process, never in the core's loop.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.core.batch import TokenLogprobs
from engine.core.messages import CoreRequest, SequenceOutput, StepOutput
from engine.core.request import RequestStatus, SamplingParams
from engine.output.detokenize import TextStream
from engine.output.outputs import (CompletionOutput, FlatPromptLogprobs, RequestMetrics,
                                   RequestOutput)
from engine.output.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ABORTED = RequestStatus.FINISHED_ABORTED.value


class _Choice:
    """One sequence's state: its text stream, its cumulative tokens and logprobs, what the
    steps since the last output added (`delta_*`), its end and its timings."""

    def __init__(self, index: int, seq_id: str, params: SamplingParams,
                 tokenizer: Tokenizer, arrival_time: float) -> None:
        self.index = index
        self.seq_id = seq_id
        self.streams = params.output_kind != "final_only"  # an output on every step
        self.sends_deltas = params.output_kind == "delta"
        self.stream = TextStream(tokenizer, params.stop,
                                 final_only=not self.streams, min_tokens=params.min_tokens,
                                 include_stop=params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.delta_text = ""
        self.delta_token_ids: list[int] = []
        self.delta_logprobs: list[TokenLogprobs] | None = None
        self.metrics = RequestMetrics(arrival_time)

    def emit(self) -> tuple[CompletionOutput, RequestMetrics]:
        """This choice's output and timings, which the caller may keep while it grows; the
        delta fields start afresh. A "delta" request's unfinished choice hands over its delta
        lists and leaves the cumulative fields (and token_times) empty; a finished choice's
        lists never change, so they are shared, not copied."""
        m = self.metrics
        if self.sends_deltas and self.finish_reason is None:
            out = CompletionOutput(self.index, "", [], None if self.logprobs is None else [],
                                   None, None, self.delta_text, self.delta_token_ids,
                                   self.delta_logprobs)
            token_times = []
        else:
            out = CompletionOutput(self.index, self.stream.text,
                                   self._final_or_copy(self.token_ids),
                                   None if self.logprobs is None
                                   else self._final_or_copy(self.logprobs),
                                   self.finish_reason, self.stop_reason, self.delta_text,
                                   self.delta_token_ids, self.delta_logprobs)
            token_times = self._final_or_copy(m.token_times)
        self.delta_text, self.delta_token_ids, self.delta_logprobs = "", [], None
        return out, RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                   token_times, m.finish_time, m.num_cached_tokens)

    def _final_or_copy(self, items: list) -> list:
        """A finished choice's lists never change: shared, not copied."""
        return items if self.finish_reason is not None else list(items)


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    choices: list[_Choice]
    error: str | None = None  # set when handling this request's output raised
    prompt_logprobs: FlatPromptLogprobs | None = None  # asked for: filled by choice 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def to_output(self) -> RequestOutput:
        """Every choice's output (see _Choice.emit); the prompt logprobs once complete."""
        outputs, metrics = zip(*map(_Choice.emit, self.choices))
        logprobs = self.prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             list(outputs), list(metrics), self.error,
                             logprobs if logprobs is not None and logprobs.complete else None)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, _Choice]] = {}  # sequence id -> owner

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float, *,
            cache_salt: str | None = None, priority: int = 0) -> list[CoreRequest]:
        """Track a request; returns its n sequences for the core. Choices of a seeded request
        get distinct, reproducible seeds; prefix-cache hits stay within one cache_salt. Prompt
        logprobs are computed by choice 0 alone (by all with max_tokens 0, which needs them)."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = _Group(request_id, prompt, prompt_token_ids, [])
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = FlatPromptLogprobs(prompt_token_ids,
                                                       self.tokenizer.token_string_table)
        sequences = []
        for i in range(params.n):
            seq_params = params if params.seed is None else replace(params, seed=params.seed + i)
            if i > 0 and params.prompt_logprobs is not None and params.max_tokens > 0:
                seq_params = replace(seq_params, prompt_logprobs=None)
            seq_id = f"{request_id}#{i}"
            group.choices.append(_Choice(i, seq_id, seq_params, self.tokenizer, arrival_time))
            sequences.append(CoreRequest(seq_id, list(prompt_token_ids), seq_params,
                                         arrival_time, cache_salt, priority))
        self._groups[request_id] = group
        for choice in group.choices:
            self._choice_of[choice.seq_id] = (group, choice)
        return sequences

    def abort(self, request_id: str) -> list[str]:
        """Forget the request; returns its sequence ids, for the core to abort."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        for choice in group.choices:
            self._choice_of.pop(choice.seq_id, None)
        return [choice.seq_id for choice in group.choices]

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def process(self, *steps: StepOutput) -> tuple[list[RequestOutput], list[str]]:
        """Apply steps, in order. Returns one output per changed request (all steps' deltas
        merged), and the sequences to abort in the core (stop string, or handling failed)."""
        changed: dict[str, _Group] = {}
        to_abort: list[str] = []
        for step in steps:
            for seq in step.outputs:
                self._take(seq.seq_id, changed, to_abort, self._apply, seq)
            new = step.new_tokens
            if new is not None:
                for seq_id, token, time in zip(new.seq_ids, new.token_ids, new.token_times):
                    self._take(seq_id, changed, to_abort, self._apply_token, token, time)
        return [self._emit(group) for group in changed.values()], to_abort

    def _take(self, seq_id: str, changed: dict[str, _Group], to_abort: list[str],
              apply: Callable[..., bool], *args) -> None:
        """Apply one sequence's output (`apply(group, choice, *args, to_abort)`: whether it
        gave the choice something to stream); its group joins `changed` if it has news."""
        owner = self._choice_of.get(seq_id)
        if owner is None:
            return  # aborted since its token was sampled
        group, choice = owner
        if choice.finish_reason is not None:
            return  # a stop string ended it; the core's abort is on its way
        try:
            news = apply(group, choice, *args, to_abort)
        except Exception as err:  # one request's failure must spare the others
            log.exception("request %s failed while handling its output", group.request_id)
            to_abort += self._fail(group, f"{type(err).__name__}: {err}")
            news = False
        # the group can only have finished with this choice
        if (group.error is not None or (choice.streams and news)
                or (choice.finish_reason is not None and group.finished)):
            changed[group.request_id] = group

    def _apply_token(self, group: _Group, choice: _Choice, token: int, time: float,
                     to_abort: list[str]) -> bool:
        """A plain row (NewTokens): one token, neither the first nor the last."""
        self._apply_tokens(choice, [token], [time], None, False)
        self._end_by_stop_string(choice, False, to_abort)
        return True

    def _apply(self, group: _Group, choice: _Choice, seq: SequenceOutput,
               to_abort: list[str]) -> bool:
        """A SequenceOutput; a prompt chunk's logprobs alone are no news: they come with the
        first token."""
        if seq.prompt_logprobs is not None and choice.index == 0:
            group.prompt_logprobs.add(seq.prompt_logprobs)
        metrics = choice.metrics
        metrics.first_scheduled_time = seq.first_scheduled_time
        metrics.num_cached_tokens = seq.num_cached_tokens
        ends = seq.finish_reason is not None
        if seq.new_token_ids:
            self._apply_tokens(choice, seq.new_token_ids, seq.new_token_times,
                               seq.new_logprobs, ends)
        if not self._end_by_stop_string(choice, ends, to_abort) and ends:
            choice.finish_reason, choice.stop_reason = seq.finish_reason, seq.stop_reason
            metrics.finish_time = seq.finish_time
        return bool(seq.new_token_ids) or ends

    @staticmethod
    def _end_by_stop_string(choice: _Choice, ends: bool, to_abort: list[str]) -> bool:
        """End the choice if its text now holds a stop string (the core is told to abort it
        unless the step ended it anyway); True if it did."""
        if choice.stream.stopped_by is None:
            return False
        # a stop string wins even when the same token also hit max_tokens (as in vLLM)
        choice.finish_reason = RequestStatus.FINISHED_STOPPED.value
        choice.stop_reason = choice.stream.stopped_by
        choice.metrics.finish_time = choice.metrics.token_times[-1]
        if not ends:
            to_abort.append(choice.seq_id)
        return True

    @staticmethod
    def _apply_tokens(choice: _Choice, tokens: list[int], times: list[float],
                      logprobs: list | None, ends: bool) -> None:
        """The step's tokens, up to the one that completes a stop string if one does (the
        rest never happened); a token without logprobs adds none."""
        stream, metrics = choice.stream, choice.metrics
        if stream.decodes_at_end:  # final-only without stop strings: every token stays
            choice.delta_text += stream.add_bulk(tokens, ends)
        else:
            last = len(tokens) - 1
            for i, token in enumerate(tokens):
                choice.delta_text += stream.add(token, ends and i == last)
                if stream.stopped_by is not None:
                    tokens = tokens[:i + 1]
                    break
        choice.delta_token_ids += tokens
        choice.token_ids += tokens
        metrics.token_times += times[:len(tokens)]
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.token_times[0]
        if choice.logprobs is not None and logprobs is not None:
            entries = [lp for lp in logprobs[:len(tokens)] if lp is not None]
            if entries:
                choice.logprobs += entries
                choice.delta_logprobs = (choice.delta_logprobs or []) + entries

    def _fail(self, group: _Group, message: str) -> list[str]:
        """End every choice of the group now; its output carries the error. Returns the
        sequences the core must abort."""
        group.error = message
        for choice in group.choices:
            if choice.finish_reason is None:
                choice.finish_reason = ABORTED
        return [choice.seq_id for choice in group.choices]

    def _emit(self, group: _Group) -> RequestOutput:
        output = group.to_output()
        if output.finished:  # a failed group is finished too: _fail ended every choice
            self.abort(group.request_id)
        return output
