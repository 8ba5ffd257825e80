"""Beam search inside the engine core. A search (a CoreRequest with `beam`) is a `BeamGroup`:
its live beams are ordinary running requests, and a step of the search is one decode step of
each, whose sampled row brings back that beam's top 2B logprobs (B = beam_width). Once every
live beam has reported, `Scheduler` applies the group's choice: each new live beam continues
its parent in place (the parent's first child) or as a fork, which shares the parent's blocks
(ref counts) and gets a copy of its partial last block (`SchedulerOutput.block_copies`);
parents without children end. The search's results, best first, are reported as sequences
`result_id(rank)` when it ends.

Selection, scoring and termination follow HF transformers' greedy `_beam_search`: the result
is `generate(num_beams=B, num_return_sequences=B, length_penalty, early_stopping)`'s, token
for token:

- Each step ranks every live beam's candidates by cumulative logprob and keeps the top 2B.
  Among them, the best B that do not end become the next live beams; an ending candidate
  (EOS, unless ignore_eos; or any candidate once max_tokens are generated) joins the
  finished hypotheses only if it ranks in the top B.
- A finished hypothesis scores cum_logprob / generated_length ** length_penalty, the
  generated length counting its EOS. At most B are kept, the best.
- The search ends when no candidate goes on (max_tokens), or, once B hypotheses are
  finished: at once with early_stopping=True; with False (and with "never" when
  length_penalty <= 0) when the best live beam, scored at its current length, cannot beat
  the worst finished one; with "never" and length_penalty > 0, scored at max_tokens.

Where vLLM's v1 beam search differs, this follows HF: vLLM keeps every EOS candidate of the
top 2B as finished, never stops before max_tokens, and applies its length penalty (over
prompt + generated tokens) only to the final ranking. Candidates are each beam's top 2B by
raw logprob, so `temperature` changes nothing (HF's beam sampling is not reproduced).
Logprobs sum in float64 (HF: float32): equal unless candidates tie within float32 rounding.

Beams are never preempted: a search is admitted only once the blocks and sequence slots of
its worst case (`reserved_blocks`, beam_width) fit beside those reserved by the searches
running, so a fork short of a block or slot always finds an ordinary request to preempt, and
a beam short of a block preempts an ordinary request after it in `running` or, with only
beams after it, waits a step for the requests before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter

from engine.core.batch import TokenLogprobs
from engine.core.request import EOS_TOKEN_ID, MAX_LOGPROBS, Request, SamplingParams

_CUM_LOGPROB = itemgetter(0)  # a candidate's sort key (_top_candidates)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, with HF's early_stopping. beam_width is at most
    MAX_LOGPROBS // 2: a step asks for 2 x beam_width logprobs."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; it does not change the result (module docstring)
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        need(is_int(self.beam_width) and 1 <= self.beam_width <= MAX_LOGPROBS // 2,
             "beam_width", f"must be an integer in [1, {MAX_LOGPROBS // 2}]")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             "must be an integer >= 1")
        need(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
             "must be a finite number >= 0")
        need(math.isfinite(self.length_penalty), "length_penalty", "must be a finite number")
        need(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
             "early_stopping", "must be true, false or \"never\"")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")

    @property
    def num_candidates(self) -> int:
        """Candidates kept per step (HF's 2B: enough that B go on even if B of them end)."""
        return 2 * self.beam_width


@dataclass(slots=True)  # built per live beam per step: slots, not frozen, for speed; read-only
class _Beam:
    generated: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    cum_logprob: float = 0.0


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens (a final EOS when it ended by one), each one's
    step logprobs (the step's top 2B, this token's as token_logprob), their sum, its score."""
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty
    ended_by_eos: bool


class BeamSearch:
    """One prompt's selection (module docstring). Invariants: at most beam_width live beams,
    ranked best first; at most beam_width finished hypotheses, best first; once `finished`,
    no live beams remain to step and `result()` holds beam_width hypotheses."""

    def __init__(self, params: BeamSearchParams, eos_token_id: int = EOS_TOKEN_ID) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self._live: list[_Beam] = [_Beam()]
        self._finished: list[Hypothesis] = []
        self._num_generated = 0
        self.finished = False

    def advance(self, results: list[TokenLogprobs]) -> list[tuple[int, int]]:
        """Apply a step: each live beam's logprobs, in rank order. Returns the next live beams,
        best first, each as (its parent's index in the live beams before, its new token);
        empty once the search has finished."""
        if self.finished:
            raise RuntimeError("advance() after the search finished")
        if len(results) != len(self._live):
            raise ValueError(f"got {len(results)} step results for {len(self._live)} beams")
        width = self.params.beam_width
        self._num_generated += 1
        at_limit = self._num_generated == self.params.max_tokens
        eos = None if self.params.ignore_eos else self.eos_token_id  # None: no token ends one
        candidates = self._top_candidates(results)
        parents, self._live, chosen = self._live, [], []
        for rank, (_, index, token, logprob) in enumerate(candidates):
            if at_limit or token == eos:
                if rank < width:
                    self._add_finished(_child(parents[index], token, logprob, results[index]),
                                       token == eos)
            else:
                self._live.append(_child(parents[index], token, logprob, results[index]))
                chosen.append((index, token))
                if len(chosen) == width:
                    break  # the candidates left rank >= beam_width: none goes on or ends
        self.finished = not self._live or self._cannot_improve()
        return [] if self.finished else chosen

    def result(self) -> list[Hypothesis]:
        """The finished hypotheses, best first."""
        if not self.finished:
            raise RuntimeError("result() before the search finished")
        return list(self._finished)

    def _top_candidates(self, results: list[TokenLogprobs]
                        ) -> list[tuple[float, int, int, float]]:
        """The step's best 2B continuations of all live beams, best first, as (cumulative
        logprob, parent index, token, logprob); ties keep the parents' order."""
        k = self.params.num_candidates
        candidates = [(beam.cum_logprob + lp, index, token, lp)
                      for index, (beam, entry) in enumerate(zip(self._live, results))
                      for token, lp in zip(entry.top_token_ids[:k], entry.top_logprobs)]
        candidates.sort(key=_CUM_LOGPROB, reverse=True)
        return candidates[:k]

    def _add_finished(self, beam: _Beam, ended_by_eos: bool) -> None:
        score = beam.cum_logprob / len(beam.generated) ** self.params.length_penalty
        self._finished.append(Hypothesis(beam.generated, beam.logprobs, beam.cum_logprob,
                                         score, ended_by_eos))
        self._finished.sort(key=lambda f: f.score, reverse=True)
        del self._finished[self.params.beam_width:]

    def _cannot_improve(self) -> bool:
        """HF's stopping rule once beam_width hypotheses are finished (module docstring)."""
        params = self.params
        if len(self._finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = self._num_generated
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = params.max_tokens
        best_possible = self._live[0].cum_logprob / length ** params.length_penalty
        return best_possible <= self._finished[-1].score


def _child(parent: _Beam, token: int, logprob: float, entry: TokenLogprobs) -> _Beam:
    chosen = TokenLogprobs(logprob, entry.top_token_ids, entry.top_logprobs)
    return _Beam(parent.generated + (token,), parent.logprobs + (chosen,),
                 parent.cum_logprob + logprob)


def reserved_blocks(num_prompt_tokens: int, params: BeamSearchParams, block_size: int) -> int:
    """The most blocks a search's live beams hold at once: the prompt's full blocks, shared by
    every beam, and each beam's own blocks past them up to prompt + max_tokens."""
    shared = num_prompt_tokens // block_size
    own = -(-(num_prompt_tokens + params.max_tokens) // block_size) - shared
    return shared + params.beam_width * own


class SearchTooLarge(ValueError):
    """A beam search that could never run; `param` names the request field to blame."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_search_fits(num_prompt_tokens: int, params: BeamSearchParams, block_size: int,
                      num_blocks: int, max_num_seqs: int) -> None:
    """SearchTooLarge if the search's worst case (reserved_blocks, beam_width sequences)
    exceeds the whole KV pool or max_num_seqs: the core would never admit it. The server runs
    the same check before queueing, so that such a search is a 400."""
    blocks = reserved_blocks(num_prompt_tokens, params, block_size)
    if blocks > num_blocks:
        raise SearchTooLarge(
            f"this beam search may hold {blocks} KV blocks of {block_size} tokens "
            f"({num_prompt_tokens} prompt tokens, {params.beam_width} beams x "
            f"{params.max_tokens}); the KV cache holds {num_blocks} blocks "
            f"({num_blocks * block_size} tokens)", "max_tokens")
    if params.beam_width > max_num_seqs:
        raise SearchTooLarge(f"this beam search runs {params.beam_width} beams; the engine runs "
                             f"at most {max_num_seqs} sequences at once (max_num_seqs)", "n")


class BeamGroup:
    """One prompt's search in the core. `live[i]` is the request computing the search's live
    beam i (ids `{group_id}/beam{k}`); `reports` holds this step's logprobs of those that
    computed it. Before its first step the only live beam is the prompt (`root`)."""

    def __init__(self, group_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 arrival_time: float, cache_salt: str | None = None, priority: int = 0) -> None:
        if not group_id.endswith("#0"):
            raise ValueError(f"a beam search's id names its first result, '<id>#0'; got "
                             f"{group_id!r}")
        self.group_id = group_id
        self.search = BeamSearch(params)
        self._num_beams = 0
        # a beam's row: greedy, with the top 2B logprobs; its sampled token is not read
        step_params = SamplingParams(max_tokens=params.max_tokens, temperature=0.0,
                                     logprobs=params.num_candidates, ignore_eos=True)
        self.root = Request(self.new_beam_id(), prompt_token_ids, step_params,
                            arrival_time=arrival_time, cache_salt=cache_salt, priority=priority)
        self.live: list[Request] = [self.root]
        self.reports: dict[str, TokenLogprobs] = {}
        self.step_times: list[float] = []  # when each step was applied: its tokens' times
        self.reserved: tuple[int, int] | None = None  # (blocks, sequences) once admitted
        self.finish_time: float | None = None

    def new_beam_id(self) -> str:
        self._num_beams += 1
        return f"{self.group_id}/beam{self._num_beams - 1}"

    def result_id(self, rank: int) -> str:
        """The sequence id of the result at `rank` (0: the best): the group's id is rank 0's."""
        return f"{self.group_id[:-1]}{rank}"

    def report(self, beam_id: str, logprobs: TokenLogprobs) -> bool:
        """A live beam's logprobs for this step; True once every live beam has reported."""
        self.reports[beam_id] = logprobs
        return len(self.reports) == len(self.live)

    def advance(self, now: float) -> list[tuple[int, int]]:
        """Take the step every live beam has reported: BeamSearch.advance's choice."""
        results = [self.reports[beam.request_id] for beam in self.live]
        self.reports.clear()
        self.step_times.append(now)
        return self.search.advance(results)
