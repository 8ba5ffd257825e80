"""The contract between the scheduler and the model runner. Data flows one way:

    Scheduler.schedule() ──SchedulerOutput──▶ ModelRunner.execute() ──RunnerOutput──▶ Scheduler.update()

The runner only reads a SchedulerOutput; it never touches Request objects. Everything it needs
to build device inputs is here, down to which row of the previous step's output a token still
being sampled comes from, so a recorded sequence of steps can be replayed or tested.

Block layout of one scheduled sequence (block_size 4, 10 tokens computed, 3 new):

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 ..
    block_ids   [  7    ,   2     ,    9      ]
                 cached    cached   9,10 computed; 10,11,12 are this step's new tokens
                                    (12 lands in a fourth block once allocated)
    slot of position p = block_ids[p // block_size] * block_size + p % block_size
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import SamplingParams


@dataclass(slots=True)  # built per sequence per step: slots, not frozen, for speed; read-only
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # the new tokens whose KV this step computes (or [PLACEHOLDER_TOKEN])
    start_position: int  # position of token_ids[0] == tokens already in the cache
    block_ids: tuple[int, ...]  # the request's whole block table, covering the new tokens
    sample: bool  # this chunk reaches the end of the sequence: sample the next token
    params: SamplingParams
    output_token_ids: tuple[int, ...] = ()  # generated so far (penalties); set only if needed
    prompt_token_ids: tuple[int, ...] = ()  # the prompt (repetition penalty); set only if needed
    num_output_tokens: int = 0  # tokens generated so far (seeded sampling, min_tokens)
    # >= 0: token_ids is [PLACEHOLDER_TOKEN], the token in this row of the previous step's
    # sampled output (see SchedulerOutput); -1: every new token is known
    prev_sample_row: int = -1
    # the last num_drafts of token_ids are a proposer's guesses: the runner samples at each
    # of them and at the token before them, and reports the ones the target accepted
    # (UNFILLED_DRAFT for the draft_model method: the draft model drafts on the device)
    num_drafts: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached tokens plus new tokens."""
        return self.start_position + len(self.token_ids)


# A token id not known yet when the step was scheduled: the one the previous step (still on
# the device) samples for this sequence, named by the sequence's prev_sample_row.
PLACEHOLDER_TOKEN = -1
# A draft slot the scheduler reserved for the draft model, whose guess the runner writes into
# the step's inputs on the device (engine/speculative/draft_model/); the scheduler learns the
# accepted ones from RunnerOutput.accepted_drafts.
UNFILLED_DRAFT = -2


@dataclass(frozen=True)
class SchedulerOutput:
    """One step. A sequence with prev_sample_row r takes its one new token from row r of the
    sampled tokens of step `step_id - 1` (the step launched just before, maybe still on the
    device), as the runner's RunnerOutput orders them:

        step 7 samples   rows  0: A   1: C   (its sample=True sequences, in order)
        step 8           B [12, 13] prev_sample_row -1 | C [PLACEHOLDER_TOKEN] prev_sample_row 1

    So a recorded sequence of SchedulerOutputs replays through a fresh runner."""
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    step_id: int = 0  # tells Scheduler.update which schedule() these results answer
    num_draft_tokens: int = 0  # the sequences' num_drafts summed (0: a step without drafts)
    # a request of this step may speculate next: apply this step before scheduling the next
    # (how many tokens it gains decides where that request goes on)
    apply_before_next: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-k alternatives (raw model logprobs)."""
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per ScheduledSequence with sample=True, in the same order. A sequence with
    drafts gains its accepted drafts and then its sampled token (the correction of the first
    rejected draft, or the bonus token after all of them)."""
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    # the leading drafts the target accepted, per sequence; empty: the step had no drafts
    accepted_drafts: list[list[int]] = field(default_factory=list)
