"""Test doubles shared by the test modules."""
from __future__ import annotations

import random
from collections.abc import Sequence

from engine.speculative.proposer import DraftContext


class ScriptedProposer:
    """A proposer that drafts what the test scripted for each request: the scripted tokens at
    the output positions after those already generated, up to k. A request with no script
    gets no drafts."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[int]] = {}

    def add(self, request_id: str, tokens: Sequence[int]) -> None:
        self.scripts[request_id] = list(tokens)

    def propose(self, context: DraftContext) -> list[int]:
        start = len(context.output_token_ids)
        return self.scripts.get(context.request_id, [])[start:start + context.max_drafts]

    def release(self, request_id: str) -> None:
        self.scripts.pop(request_id, None)


def drafts_at_rate(reference: Sequence[int], rate: float, seed: int,
                   vocab_size: int) -> list[int]:
    """reference with each token kept with probability `rate` and otherwise replaced by the
    next id: scripted drafts that a target whose output is `reference` accepts at that rate
    (all of them at 1, none at 0)."""
    rng = random.Random(seed)
    return [t if rng.random() < rate else (t + 1) % vocab_size for t in reference]
