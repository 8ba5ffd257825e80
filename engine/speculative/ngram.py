"""N-gram prompt lookup: if the request's last n tokens occurred before (in the prompt or the
output so far), guess that what followed them then follows now.

    tokens   ... the cat sat on the mat . the cat | ?       last 2 tokens: "the cat"
                 ^^^^^^^ most recent prior match     proposal: "sat on the mat" (k = 4)

n goes from prompt_lookup_max down to prompt_lookup_min; the first n with a match wins, its
most recent occurrence supplies the proposal. A match near the end copies on through its own
proposal (as LZ77 overlaps), so a request caught in a loop gets k drafts of the loop:

    tokens   ... 7 8 9 7 8 | ?        last 2: "7 8", latest match ends 2 back
    proposal     9 7 8 9              (k = 4: 9, then the proposal's own 7 8 9)

A per-request index (n-gram -> end of its latest occurrence with a token after it) makes a
step O((max - min + 1) * max) per request, whatever the context length.
"""
from __future__ import annotations

from engine.speculative.proposer import DraftContext


class _RequestIndex:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.latest_end: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest match

    def extend(self, context: DraftContext, min_n: int, max_n: int) -> None:
        """Take the request's new tokens; index each n-gram that now has a token after it."""
        old = len(self.tokens)
        self.tokens += context.tokens(old, context.num_tokens)
        tokens, latest_end = self.tokens, self.latest_end
        for end in range(max(old - 1, 0), len(tokens) - 1):
            for n in range(min_n, min(max_n, end + 1) + 1):
                latest_end[tuple(tokens[end - n + 1:end + 1])] = end

    def lookup(self, min_n: int, max_n: int, max_drafts: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            end = self.latest_end.get(tuple(tokens[-n:]))
            if end is not None:
                return _copy(tokens, end + 1, max_drafts)
        return []


def _copy(tokens: list[int], start: int, count: int) -> list[int]:
    """count tokens from tokens[start:], going on through the copy itself past the end."""
    period = len(tokens) - start  # >= 1: a match always has a token after it
    follow = tokens[start:start + count]
    return [follow[i % period] for i in range(count)] if count > period else follow


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min} and {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[str, _RequestIndex] = {}

    def propose(self, context: DraftContext) -> list[int]:
        index = self._indexes.get(context.request_id)
        if index is None or len(index.tokens) > context.num_tokens:  # new, or a reused id
            index = self._indexes[context.request_id] = _RequestIndex()
        index.extend(context, self.min_n, self.max_n)
        if context.max_drafts <= 0:
            return []
        return index.lookup(self.min_n, self.max_n, context.max_drafts)

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        """It holds an index of this request's tokens (released with the request)."""
        return request_id in self._indexes
