"""A proposer whose acceptance rate the benchmark sets: it replays a known continuation (the
target's own greedy output) and corrupts each proposed token with probability 1 - a.

Random weights make real acceptance meaningless, so scripts/bench_spec.py measures speedup
against a with this. Each output position's draft is fixed when the request is added, from a
generator seeded by (seed, request id): a position is judged by the target at most once (a
rejection ends the run and the target's own token takes it), so every judged draft is an
independent Bernoulli(a) hit, as the analytic model (1 - a^(k+1)) / ((1 - a)(k c + 1))
assumes, and a run is reproducible whatever the batching.
"""
from __future__ import annotations

import random
from typing import Sequence

from engine.speculative.proposer import DraftContext


class OracleProposer:
    def __init__(self, acceptance_rate: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 to corrupt a token, got {vocab_size}")
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.seed = seed
        self._drafts: dict[str, list[int]] = {}

    def add(self, request_id: str, reference: Sequence[int], key: str | None = None) -> None:
        """The continuation to replay for a request, from its first output token on; its
        corruptions drawn from (seed, key), the request id unless given (a benchmark's
        rounds key them by prompt, so each replays the pattern of its seed)."""
        # a str seed is hashed with sha512: the same stream in every process
        rng = random.Random(f"{self.seed}:{request_id if key is None else key}")
        drafts = []
        for token in reference:
            if rng.random() < self.acceptance_rate:
                drafts.append(token)
            else:  # any other token: shift by 1 .. vocab - 1
                drafts.append((token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size)
        self._drafts[request_id] = drafts

    def propose(self, context: DraftContext) -> list[int]:
        return self.drafts_at(context.request_id, len(context.output_token_ids),
                              context.max_drafts)

    def drafts_at(self, request_id: str, num_output_tokens: int, k: int) -> list[int]:
        """The drafts for the k positions after the first num_output_tokens generated."""
        return self._drafts.get(request_id, [])[num_output_tokens:num_output_tokens + k]

    def release(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
