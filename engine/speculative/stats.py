"""Speculative decoding's counters, under vLLM's metric names. Pure Python: the scheduler
adds each verified row in `update`; `/metrics` and `LLM.get_metrics()` read them.

    vllm:spec_decode_num_drafts                 rows verified with at least one draft
    vllm:spec_decode_num_draft_tokens           drafts proposed
    vllm:spec_decode_num_accepted_tokens        drafts accepted
    vllm:spec_decode_num_accepted_tokens_per_pos  [i]: rows whose draft i was accepted
"""
from __future__ import annotations

from dataclasses import dataclass, field

PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class Counter:
    """vLLM's `vllm.v1.metrics.reader.Counter`: one cumulative count."""
    name: str
    value: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Vector:
    """vLLM's `vllm.v1.metrics.reader.Vector`: a cumulative count per index."""
    name: str
    values: list[int]
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class SpecDecodingStats:
    num_speculative_tokens: int  # k: the per-position counter's length
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified row: its drafts, and how many leading ones the target accepted."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafts "
                             f"({num_draft_tokens}) <= k ({self.num_speculative_tokens})")
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (the server log's figure)."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating row gains per step: the accepted drafts plus the next token."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    def metrics(self) -> list[Counter | Vector]:
        return [Counter(PREFIX + "num_drafts", self.num_drafts),
                Counter(PREFIX + "num_draft_tokens", self.num_draft_tokens),
                Counter(PREFIX + "num_accepted_tokens", self.num_accepted_tokens),
                Vector(PREFIX + "num_accepted_tokens_per_pos",
                       list(self.num_accepted_tokens_per_pos))]
