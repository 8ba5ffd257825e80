"""Per-choice text state: incremental detokenization plus stop-string matching.

Text that could be the start of a stop string is held back until it is known not to be one,
so a stream never emits text it would have to take back:

    stop = ["###"]      tokens "ab", "c#", "#", "#x"
    emitted             "ab", "c",  "",  (stop found: "###" dropped, finished)
"""
from __future__ import annotations

import functools

from engine.core.request import EOS_TOKEN_ID
from engine.output.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """`final_only` without stop strings: tokens are decoded once, in bulk, at the end. As in
    vLLM, stop strings match only once more than `min_tokens` tokens are out, and
    `include_stop` keeps the one that ended the text in it. Without stop strings a token costs
    a table lookup: nothing is matched or held back. The emitted text is kept in pieces,
    joined when read (`text`), so a token never copies the text before it."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...],
                 final_only: bool = False, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self.decodes_at_end = final_only and not stop  # (not a property: read every step)
        self._bulk: list[int] = []  # the tokens a stream that decodes_at_end holds
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = stop_strings(stop) if stop else None
        self._holdback = self._stop.longest - 1 if self._stop else 0
        self._min_tokens, self._include_stop = min_tokens, include_stop
        self._num_tokens = 0  # fed to the stop-string matching
        self._pending = ""
        self._pieces: list[str] = []  # everything emitted so far
        self.stopped_by: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int, final: bool) -> str:
        """Feed one token (special tokens add no text); returns the text now safe to emit.
        After a stop string is found, everything further is dropped."""
        if self.stopped_by is not None:
            return ""
        if self.decodes_at_end:
            return self.add_bulk((token_id,), final)
        piece = "" if token_id == EOS_TOKEN_ID else self._detokenizer.add(token_id)
        if final:
            piece += self._detokenizer.flush()
        if self._stop is None:
            self._pieces.append(piece)
            return piece
        self._num_tokens += 1
        return self._emit(self._pending + piece, final)

    def add_bulk(self, token_ids: list[int] | tuple[int, ...], final: bool) -> str:
        """add() of each token, the last one `final`, for a stream that decodes_at_end (no
        stop string can end it early): one call for a finished request's many tokens."""
        self._bulk += [t for t in token_ids if t != EOS_TOKEN_ID]
        if not final:
            return ""
        self._pieces = [self._tokenizer.decode(self._bulk)]
        return self._pieces[0]

    def _emit(self, buffer: str, final: bool) -> str:
        """`buffer`: the held-back text, then this token's."""
        matching = self._num_tokens > self._min_tokens
        hit = self._stop.find(buffer, len(self._pending)) if matching else None
        if hit:
            index, self.stopped_by = hit
            end = index + len(self.stopped_by) if self._include_stop else index
            out, self._pending = buffer[:end], ""
        elif final or self._holdback == 0:
            out, self._pending = buffer, ""
        else:
            cut = max(len(buffer) - self._holdback, 0)
            out, self._pending = buffer[:cut], buffer[cut:]
        self._pieces.append(out)
        return out


@functools.lru_cache(maxsize=1)
def stop_strings(stop: tuple[str, ...]) -> StopStrings:
    """The index of `stop`, built once and shared by a request's n choices."""
    return StopStrings(stop)


class StopStrings:
    """A request's stop strings, with the lengths of those ending in each character (longest
    first): each new character costs one set lookup per such length, however many strings."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._strings = frozenset(stop)
        lengths: dict[str, list[int]] = {}
        for last, length in sorted({(s[-1], len(s)) for s in self._strings}, reverse=True):
            lengths.setdefault(last, []).append(length)
        self._lengths = lengths
        self.longest = max(longest_first[0] for longest_first in lengths.values())

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """The stop string in `text` that ends at or after `new_from` and starts first (of
        two starting together, the shorter), as (its index, it); None if there is none."""
        best: tuple[int, str] | None = None
        for end in range(new_from, len(text)):
            for length in self._lengths.get(text[end], ()):
                start = end + 1 - length
                if start < 0:
                    continue
                if best is not None and start >= best[0]:
                    break  # shorter ones start later still
                if text[start:end + 1] in self._strings:
                    best = (start, text[start:end + 1])
                    break
        return best
