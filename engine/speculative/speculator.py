"""The scheduler's side of speculative decoding, pure Python: each step, how many drafts
(the switch-off's choice, or k), which requests may speculate, their drafts (the proposer),
and the counters of what the target accepted.

    Scheduler.schedule()   speculator.begin_step(B)      k for this step (0: plain decode)
                           speculator.propose(request)   drafts of a decoding request
    Scheduler.update()     speculator.observe(d, n)      counters, acceptance estimate
"""
from __future__ import annotations

from engine.core.config import EngineConfig
from engine.core.messages import SpecCounts
from engine.core.request import Request
from engine.speculative.draft_slots import DraftSlots
from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftContext, Proposer
from engine.speculative.stats import SpecDecodingStats
from engine.speculative.switch import SpeculationSwitch, StepTimes


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
                 switch: SpeculationSwitch | None = None, lookahead: int = 0) -> None:
        """`switch` None: every step drafts up to k. `lookahead`: positions past a
        verification whose blocks a speculating request keeps (`Drafter.draft_ahead`)."""
        self.proposer = proposer
        self.max_k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.switch = switch
        self.lookahead = lookahead
        self.stats = SpecDecodingStats(num_speculative_tokens)
        self.k = num_speculative_tokens if switch is None else 0  # this step's draft length

    def begin_step(self, batch_size: int) -> int:
        self.k = self.max_k if self.switch is None else min(self.switch.choose(batch_size),
                                                            self.max_k)
        return self.k

    def may_speculate(self, request: Request) -> bool:
        """This step drafts and the request's next positions can be sampled independently of
        each other: no penalties or bad words (they read the output so far), no
        allowed_token_ids or structured outputs (token masks stay on the sampler's
        one-position path), no logprobs (one entry per step), min_tokens reached (no stop
        token is banned at any position)."""
        params = request.params
        return (self.k > 0 and not params.needs_output_tokens
                and params.allowed_token_ids is None and params.structured_outputs is None
                and params.logprobs is None
                and request.num_output_tokens >= params.min_tokens)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Drafts for a decoding request whose tokens are all known, at most max_drafts
        (the step's token budget left after its last token)."""
        context = DraftContext.of(request, min(self.k, max_drafts), self.max_model_len)
        return self.proposer.propose(context)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.stats.observe(num_drafts, num_accepted)
        if self.switch is not None:
            self.switch.observe(num_drafts, num_accepted)

    def release(self, request_id: str) -> None:
        self.proposer.release(request_id)

    def counts(self) -> SpecCounts:
        stats = self.stats
        return SpecCounts(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                          list(stats.num_accepted_tokens_per_pos), self.k)


def build_speculator(config: EngineConfig, times: StepTimes | None) -> Speculator | None:
    """The speculator config.speculative asks for (None: off). The switch-off decides per
    step from `times`; without them every step speculates."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer, lookahead = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max), 0
    else:
        proposer, lookahead = DraftSlots(), spec.num_speculative_tokens
    return Speculator(proposer, spec.num_speculative_tokens, config.scheduler.max_model_len,
                      None if times is None else SpeculationSwitch(times), lookahead)
