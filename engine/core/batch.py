"""The contract between the scheduler and the model runner. Data flows one way:

    Scheduler.schedule() ──SchedulerOutput──▶ ModelRunner.execute() ──RunnerOutput──▶ Scheduler.update()

The runner reads only these types, never a Request, so recorded steps replay through a fresh
runner. Block layout of one sequence (block_size 4, 10 tokens computed, 3 new: 10, 11, 12):

    positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 ..
    block_ids   [  7    ,   2     ,    9      , (a fourth block, allocated for 12)]
    slot of position p = block_ids[p // block_size] * block_size + p % block_size
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.core.request import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class PromptLogprobsJob:
    """Prompt positions whose next-token logprobs a step reports: new-token rows first_row + i,
    each scored against target_ids[i] (the prompt token after it), with its num_top likeliest."""
    first_row: int
    target_ids: tuple[int, ...]
    num_top: int


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
    # >= 0: token_ids is [PLACEHOLDER_TOKEN], from this row of the last step's samples; -1: none
    prev_sample_row: int = -1
    # the last num_drafts of token_ids are guesses, sampled at and verified (accepted_drafts)
    num_drafts: int = 0
    prompt_logprobs: PromptLogprobsJob | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Context length after this step: cached tokens plus new tokens."""
        return self.start_position + len(self.token_ids)


PLACEHOLDER_TOKEN = -1  # sampled by the previous step, still on the device (prev_sample_row)
UNFILLED_DRAFT = -2  # a draft slot the draft model fills on the device


@dataclass(frozen=True)
class DecodeContinuation:
    """A steady decode step sent as what changed: its row i is row src[i] of the step before
    it (step_id - 1; src None: row i, every row of it), a step whose every row sampled one
    token, and decodes that token (a placeholder, prev_sample_row = src[i]) one position
    further. The rows whose new position starts a block append the block of `new_blocks`
    (row, block id). No Python work per row to build or read it but for those rows (and
    C-level passes where src is given)."""
    request_ids: list[str]
    new_blocks: tuple[tuple[int, int], ...] = ()
    src: tuple[int, ...] | None = None

    def expand(self, last: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The rows in full, given the step before's."""
        src = range(len(last)) if self.src is None else self.src
        rows = [ScheduledSequence(s.request_id, [PLACEHOLDER_TOKEN], s.start_position + 1,
                                  s.block_ids, True, s.params, (), (),
                                  s.num_output_tokens + 1, i)
                for i, s in zip(src, map(last.__getitem__, src))]
        for row, block_id in self.new_blocks:
            rows[row].block_ids = rows[row].block_ids + (block_id,)
        return rows


@dataclass(frozen=True)
class SchedulerOutput:
    """One step. A sequence with prev_sample_row r takes its one new token from row r of the
    sampled tokens of step `step_id - 1` (the step launched just before, maybe still on the
    device), as the runner's RunnerOutput orders them:

        step 7 samples   rows  0: A   1: C   (its sample=True sequences, in order)
        step 8           B [12, 13] prev_sample_row -1 | C [PLACEHOLDER_TOKEN] prev_sample_row 1
    """
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    step_id: int = 0  # tells Scheduler.update which schedule() these results answer
    num_draft_tokens: int = 0  # the sequences' num_drafts summed (0: a step without drafts)
    # a request here may speculate, or is a beam (its group picks the next token): apply
    # before the next step is scheduled
    apply_before_next: bool = False
    has_prompt_logprobs: bool = False  # some sequence has a PromptLogprobsJob
    num_tokens: int = -1  # the sequences' new tokens summed; -1: summed here
    # (src, dst) block pairs: before the forward, block dst of every layer's K and V becomes a
    # copy of block src (a forked beam's copy of its parent's partial last block)
    block_copies: tuple[tuple[int, int], ...] = ()
    # set: the step's rows are this continuation of the step before's, and `sequences` is
    # empty (StepRows gives them in full)
    continued: DecodeContinuation | None = None

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            num_tokens = (len(self.continued.request_ids) if self.continued is not None
                          else sum(len(s.token_ids) for s in self.sequences))
            object.__setattr__(self, "num_tokens", num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.sequences and self.continued is None


class StepRows:
    """The rows of the last step a consumer of SchedulerOutputs was given, so that a
    continued step (SchedulerOutput.continued) reads in full. Give it every step, in order:
    `full` for a step whose rows it reads, `skip` for a continued one it acts on without them
    (after which the next continued step cannot be expanded: it must be skipped too)."""

    def __init__(self) -> None:
        self._step_id = -1
        self._rows: list[ScheduledSequence] | None = None  # None: not read (skipped)

    def full(self, out: SchedulerOutput) -> SchedulerOutput:
        """`out`, with a continuation expanded into its `sequences`."""
        if out.continued is not None:
            if self._step_id != out.step_id - 1 or self._rows is None:
                raise RuntimeError(f"step {out.step_id} continues a step whose rows this "
                                   "consumer did not read")
            out = replace(out, sequences=out.continued.expand(self._rows), continued=None)
        self._step_id, self._rows = out.step_id, out.sequences
        return out

    def skip(self, out: SchedulerOutput) -> None:
        self._step_id, self._rows = out.step_id, None


@dataclass(frozen=True)
class GrammarMask:
    """The tokens each constrained row of a step may sample (engine/structured/): its rows are
    the step's sample=True sequences with structured_outputs, in the step's order. Bit t % 32
    of word t // 32 of a row is 1 when token t keeps the row's constraint satisfiable."""
    request_ids: list[str]
    bitmask: np.ndarray  # int32 [len(request_ids), ceil(vocab / 32)]


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-k alternatives (raw model logprobs)."""
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class PromptLogprobs:
    """Raw model logprobs of a run of prompt tokens, column-wise: prompt token first_index + i
    has token_logprobs[i], rank ranks[i] (tokens at least as likely, itself included: 1 is the
    likeliest) and its position's top tokens, likeliest first. Token 0 never has any."""
    first_index: int
    token_logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(frozen=True)
class RunnerOutput:
    """One entry per ScheduledSequence with sample=True, in the same order. A sequence with
    drafts gains its accepted drafts and then its sampled token (the correction of the first
    rejected draft, or the bonus token after all of them)."""
    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    accepted_drafts: list[list[int]] = field(default_factory=list)  # per sequence; []: none
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # by request id
