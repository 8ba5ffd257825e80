"""Beam search outside the engine core, as vLLM v1 runs it: every step asks the engine for one
token of every live beam, with the top 2 x beam_width logprobs, and extends the beams from
those candidates. Each one-token request holds its beam's whole token list; the prefix cache
shares the beams' full KV blocks, so a step computes only each beam's last, partial block.

`BeamSearch` is one prompt's search; the offline `LLM.beam_search` and the server
(server/beam_search.py) drive it alike:

    search = BeamSearch(prompt_token_ids, params)
    while not search.finished:
        requests = search.requests()          # one token list per live beam
        results = <run each with search.step_params>
        search.advance([step_result(r) for r in results])
    search.result()                           # best first, at most beam_width

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
Returned tokens hold the prompt, as vLLM's do; a final EOS only with
include_stop_str_in_output. Logprobs sum in float64 (HF: float32): equal unless candidates
tie within float32 rounding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.core.batch import TokenLogprobs
from engine.core.request import EOS_TOKEN_ID, MAX_LOGPROBS, SamplingParams
from engine.output.outputs import RequestOutput


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


@dataclass
class BeamSearchSequence:
    """One returned beam. `tokens`: prompt then generated (a final EOS only with
    include_stop_str_in_output); `logprobs`: per generated token, a final EOS included, the
    step's top 2B with this beam's token as `token_logprob`; `text`: the caller's to fill."""
    tokens: list[int]
    logprobs: list[TokenLogprobs]
    cum_logprob: float
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    stop_reason: int | None  # the EOS id when it ended by EOS
    num_prompt_tokens: int
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]

    def text_token_ids(self, with_prompt: bool) -> list[int]:
        """The tokens whose text is the output's: no final EOS; the prompt first if asked."""
        end = len(self.tokens)
        if (self.stop_reason is not None and end > self.num_prompt_tokens
                and self.tokens[-1] == self.stop_reason):
            end -= 1  # a kept EOS has no text
        return self.tokens[0 if with_prompt else self.num_prompt_tokens:end]


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first: beam_width of them."""
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True)
class _Beam:
    generated: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    cum_logprob: float = 0.0


@dataclass(frozen=True)
class _Finished:
    beam: _Beam
    score: float  # cum_logprob / generated_length ** length_penalty
    ended_by_eos: bool


@dataclass(frozen=True)
class _Candidate:
    cum_logprob: float
    parent: _Beam
    token: int
    logprob: float
    entry: TokenLogprobs  # the parent's step logprobs

    def child(self) -> _Beam:
        chosen = TokenLogprobs(self.logprob, self.entry.top_token_ids, self.entry.top_logprobs)
        parent = self.parent
        return _Beam(parent.generated + (self.token,), parent.logprobs + (chosen,),
                     self.cum_logprob)


class BeamSearch:
    """One prompt's beam search (module docstring). Invariants: at most beam_width live
    beams, ranked best first; at most beam_width finished hypotheses, best first; once
    `finished`, no live beams remain to step and `result()` holds beam_width sequences."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int = EOS_TOKEN_ID) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.step_params = SamplingParams(max_tokens=1, temperature=0.0,
                                          logprobs=params.num_candidates)
        self._live: list[_Beam] = [_Beam()]
        self._finished: list[_Finished] = []
        self._num_generated = 0
        self.finished = False

    def requests(self) -> list[list[int]]:
        """Each live beam's prompt + generated tokens, best first; empty once finished."""
        if self.finished:
            return []
        return [self.prompt_token_ids + list(beam.generated) for beam in self._live]

    def advance(self, results: list[TokenLogprobs]) -> None:
        """Apply a step: the logprobs of each request of `requests()`, in that order."""
        if self.finished:
            raise RuntimeError("advance() after the search finished")
        if len(results) != len(self._live):
            raise ValueError(f"got {len(results)} step results for {len(self._live)} beams")
        candidates = self._top_candidates(results)
        self._num_generated += 1
        at_limit = self._num_generated == self.params.max_tokens
        self._live = []
        for rank, candidate in enumerate(candidates):
            is_eos = candidate.token == self.eos_token_id and not self.params.ignore_eos
            if is_eos or at_limit:
                if rank < self.params.beam_width:
                    self._add_finished(candidate.child(), is_eos)
            elif len(self._live) < self.params.beam_width:
                self._live.append(candidate.child())
        self.finished = not self._live or self._cannot_improve()

    def result(self) -> list[BeamSearchSequence]:
        """The finished hypotheses, best first."""
        if not self.finished:
            raise RuntimeError("result() before the search finished")
        return [self._sequence(f) for f in self._finished]

    def _top_candidates(self, results: list[TokenLogprobs]) -> list[_Candidate]:
        """The step's best 2B continuations of all live beams, best first."""
        candidates = []
        for beam, entry in zip(self._live, results):
            candidates += [_Candidate(beam.cum_logprob + lp, beam, token, lp, entry)
                           for token, lp in zip(entry.top_token_ids[:self.params.num_candidates],
                                                entry.top_logprobs)]
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
        return candidates[:self.params.num_candidates]

    def _add_finished(self, beam: _Beam, ended_by_eos: bool) -> None:
        score = beam.cum_logprob / len(beam.generated) ** self.params.length_penalty
        self._finished.append(_Finished(beam, score, ended_by_eos))
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

    def _sequence(self, finished: _Finished) -> BeamSearchSequence:
        beam = finished.beam
        generated = list(beam.generated)
        if finished.ended_by_eos and not self.params.include_stop_str_in_output:
            generated.pop()
        return BeamSearchSequence(
            self.prompt_token_ids + generated, list(beam.logprobs), beam.cum_logprob,
            "stop" if finished.ended_by_eos else "length",
            self.eos_token_id if finished.ended_by_eos else None, len(self.prompt_token_ids))


def step_result(output: RequestOutput) -> TokenLogprobs:
    """A finished one-token request's logprobs, as `advance` takes them."""
    choice = output.outputs[0]
    if not choice.logprobs:
        raise RuntimeError(f"beam step {output.request_id} ended without a token "
                           f"({choice.finish_reason})")
    return choice.logprobs[0]
