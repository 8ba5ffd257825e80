"""Per-choice text state: incremental detokenization plus stop-string matching.

Text that could be the start of a stop string is held back until it is known not to be one,
so a stream never emits text it would have to take back:

    stop = ["###"]      tokens "ab", "c#", "#", "#x"
    emitted             "ab", "c",  "",  (stop found: "###" dropped, finished)
"""
from __future__ import annotations

from engine.core.request import EOS_TOKEN_ID
from engine.output.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """`final_only`: nobody reads text before the end and no stop string needs matching, so
    tokens are decoded once, in bulk, when the sequence ends (far cheaper per token).
    As in vLLM, stop strings are matched only once more than `min_tokens` tokens are out, and
    `include_stop` keeps the stop string that ended the text in it."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...],
                 final_only: bool = False, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self._bulk: list[int] | None = [] if final_only and not stop else None
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._min_tokens, self._include_stop = min_tokens, include_stop
        self._num_tokens = 0
        self._pending = ""
        self.text = ""  # everything emitted so far
        self.stopped_by: str | None = None

    @property
    def decodes_at_end(self) -> bool:
        return self._bulk is not None

    def add(self, token_id: int, final: bool) -> str:
        """Feed one token (special tokens add no text); returns the text now safe to emit.
        After a stop string is found, everything further is dropped."""
        if self.stopped_by is not None:
            return ""
        self._num_tokens += 1
        if self._bulk is not None:
            if token_id != EOS_TOKEN_ID:
                self._bulk.append(token_id)
            if not final:
                return ""
            self.text = self._tokenizer.decode(self._bulk)
            return self.text
        piece = "" if token_id == EOS_TOKEN_ID else self._detokenizer.add(token_id)
        if final:
            piece += self._detokenizer.flush()
        if not self._stop:  # nothing to match or hold back
            self.text += piece
            return piece
        return self._emit(self._pending + piece, final)

    def _emit(self, buffer: str, final: bool) -> str:
        matching = self._stop and self._num_tokens > self._min_tokens
        hit = min(((buffer.find(s), s) for s in self._stop if s in buffer),
                  default=None) if matching else None
        if hit:
            index, self.stopped_by = hit
            end = index + len(self.stopped_by) if self._include_stop else index
            out, self._pending = buffer[:end], ""
        elif final or self._holdback == 0:
            out, self._pending = buffer, ""
        else:
            cut = max(len(buffer) - self._holdback, 0)
            out, self._pending = buffer[:cut], buffer[cut:]
        self.text += out
        return out
