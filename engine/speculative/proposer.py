"""The one interface every proposer meets, and what it sees of a request. Proposers run in
the scheduler while it builds a step (a speculating request's tokens are all known then).
Drafts must be deterministic (one-hot q): that keeps `accept_drawn` exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class DraftContext:
    """A read-only view of one request at schedule time; its token lists are the request's
    own, not copies, so a step costs O(new tokens)."""
    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    max_drafts: int  # k, cut so that accepted drafts and the bonus fit max_tokens and context

    @classmethod
    def of(cls, request: Request, k: int, max_model_len: int) -> DraftContext:
        room = min(request.params.max_tokens - request.num_output_tokens,
                   max_model_len - request.num_tokens) - 1
        return cls(request.request_id, request.prompt_token_ids, request.output_token_ids,
                   max(0, min(k, room)))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        return (list(self.prompt_token_ids[start:min(end, num_prompt)])
                + list(self.output_token_ids[max(start - num_prompt, 0):
                                             max(end - num_prompt, 0)]))


class Proposer(Protocol):
    def propose(self, context: DraftContext) -> list[int]:
        """Up to context.max_drafts guesses of the tokens after context's last token (fewer,
        or none, when the proposer has no guess)."""

    def release(self, request_id: str) -> None:
        """Forget per-request state: the request finished, or its id is about to be reused."""
