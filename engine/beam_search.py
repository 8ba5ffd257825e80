"""Beam search, the frontends' side: the offline `LLM.beam_search` and the server
(server/beam_search.py) send each prompt's search to the engine core as one request, which
runs it there (engine/core/beam.py: the selection rules, HF transformers' `_beam_search`
token for token) and reports its beam_width results when it ends:

    OutputProcessor.add(id, prompt, search_params(params))   beam_width final-only choices
      ─▶ beam_search_requests(...)                             one CoreRequest, with `beam`
      ─▶ RequestOutput, its choices the results, best first  ─▶ beam_sequences(...)

Returned tokens hold the prompt, as vLLM's do; a final EOS only with
include_stop_str_in_output (its logprobs are always there).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.core.batch import TokenLogprobs
from engine.core.beam import BeamSearchParams
from engine.core.messages import CoreRequest
from engine.core.request import SamplingParams
from engine.output.outputs import RequestOutput

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "search_params",
           "beam_search_requests", "beam_sequences"]


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


def search_params(params: BeamSearchParams) -> SamplingParams:
    """A search as the frontend tracks it (OutputProcessor, admission): beam_width final-only
    choices with their logprobs, each of up to max_tokens."""
    return SamplingParams(n=params.beam_width, max_tokens=params.max_tokens, temperature=0.0,
                          ignore_eos=params.ignore_eos, logprobs=params.num_candidates,
                          output_kind="final_only")


def beam_search_requests(sequences: list[CoreRequest],
                         params: list[BeamSearchParams]) -> list[CoreRequest]:
    """Each prompt's choices (beam_width each, in order, as OutputProcessor.add returns them)
    as one core request: the first choice's, carrying its search."""
    starts = [0]
    for p in params[:-1]:
        starts.append(starts[-1] + p.beam_width)
    return [msgspec.structs.replace(sequences[start], beam=p) for start, p in zip(starts, params)]


def beam_sequences(output: RequestOutput, params: BeamSearchParams) -> list[BeamSearchSequence]:
    """A finished search's output as its sequences, best first (text left to the caller)."""
    prompt = output.prompt_token_ids
    sequences = []
    for choice in output.outputs:
        generated = list(choice.token_ids)
        if choice.stop_reason is not None and not params.include_stop_str_in_output:
            generated.pop()  # the EOS that ended it
        cum_logprob = 0.0
        for entry in choice.logprobs:  # in order: the sum the search ranked by
            cum_logprob += entry.token_logprob
        sequences.append(BeamSearchSequence(prompt + generated, list(choice.logprobs),
                                            cum_logprob, choice.finish_reason,
                                            choice.stop_reason, len(prompt)))
    return sequences
