"""What the engine hands to its users (the offline LLM and the HTTP server).

RequestMetrics and CompletionOutput are msgspec Structs: the server builds one of each per
streamed chunk, and a Struct is built in C, not by a Python __init__. They hold numbers,
strings and lists of those, never a cycle: gc=False keeps them out of the collector's walks.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import TypeVar

import msgspec

from engine.core.batch import PromptLogprobs, TokenLogprobs
from engine.core.request import MAX_LOGPROBS


class Logprob(msgspec.Struct, gc=False):
    """vLLM's Logprob: a token's raw model logprob at one position, its rank there (1: the
    likeliest; ties count against it) and its text. A Struct: prompt logprobs build up to
    k + 1 per prompt position when read."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one prompt position's columns: (its token, the token's logprob, its rank, the top-k's ids,
# their logprobs, likeliest first)
PromptLogprobsRow = tuple[int, float, int, list[int], list[float]]
TOP_RANKS = range(1, MAX_LOGPROBS + 1)  # zip stops at a row's top-k
Entry = TypeVar("Entry")  # a map's value: Logprob, or the server's JSON entry


class FlatPromptLogprobs(Sequence[dict[int, Logprob] | None]):
    """vLLM's prompt logprobs, kept as the columns the engine's chunks bring (PromptLogprobs)
    and read as vLLM's list: None at prompt position 0 (nothing precedes it), then per position
    a map from token ids to Logprobs, built only when read: built as the chunks came, a
    position's map and Logprobs cost ~1.8 us on the GPU node's host (0.94 ms for 512 tokens,
    k=1), and the server never reads them (it builds its JSON entries through `maps`, and
    echo's through `rows()`).

    Invariant: the columns hold positions 1..len(token_logprobs), each once, in order: `add`
    appends a chunk only where it continues them and ends inside the prompt. A position that has
    not arrived reads None; the processor hands the container over once `complete`, and never
    changes it after."""
    __slots__ = ("prompt_token_ids", "token_strings", "token_logprobs", "ranks",
                 "top_token_ids", "top_logprobs")

    def __init__(self, prompt_token_ids: list[int], token_strings: Sequence[str]) -> None:
        """`token_strings`: decode([t]) by token id t (Tokenizer.token_string_table)."""
        self.prompt_token_ids, self.token_strings = prompt_token_ids, token_strings
        self.token_logprobs: list[float] = []  # [i]: prompt position i + 1's
        self.ranks: list[int] = []
        self.top_token_ids: list[list[int]] = []
        self.top_logprobs: list[list[float]] = []

    def add(self, chunk: PromptLogprobs) -> None:
        """Append the chunk's columns. IndexError, adding nothing, unless it starts at the first
        position not arrived yet and ends inside the prompt."""
        first, count = chunk.first_index, len(chunk.token_logprobs)
        if first != len(self.token_logprobs) + 1 or first + count > len(self.prompt_token_ids):
            raise IndexError(f"prompt logprobs for positions {first}..{first + count - 1} of "
                             f"a {len(self.prompt_token_ids)}-token prompt whose positions "
                             f"1..{len(self.token_logprobs)} have arrived")
        self.token_logprobs += chunk.token_logprobs
        self.ranks += chunk.ranks
        self.top_token_ids += chunk.top_token_ids
        self.top_logprobs += chunk.top_logprobs

    @property
    def complete(self) -> bool:
        """Every position 1..len - 1 has arrived."""
        return len(self.token_logprobs) == len(self.prompt_token_ids) - 1

    def rows(self) -> Iterator[PromptLogprobsRow]:
        """The arrived positions' columns, position 1 first; nothing is built."""
        return zip(islice(self.prompt_token_ids, 1, None), self.token_logprobs, self.ranks,
                   self.top_token_ids, self.top_logprobs)

    def maps(self, entry: Callable[[float, int, str], Entry] = Logprob
             ) -> Iterator[dict[int, Entry]]:
        """vLLM's map of each arrived position, position 1 first, each value
        entry(logprob, rank, text) (the server's JSON entries come this way too)."""
        return self._maps(self.rows(), entry)

    def _maps(self, rows: Iterable[PromptLogprobsRow], entry: Callable[[float, int, str], Entry]
              ) -> Iterator[dict[int, Entry]]:
        """vLLM's map of each row: the token's own entry first, unless the token is among the
        top-k: then its key still comes first but holds its top-k entry; then the top-k,
        ranked 1..k."""
        text = self.token_strings
        for token, logprob, rank, top_ids, top_logprobs in rows:
            row = {token: None if token in top_ids else entry(logprob, rank, text[token])}
            for top_rank, top, top_logprob in zip(TOP_RANKS, top_ids, top_logprobs):
                row[top] = entry(top_logprob, top_rank, text[top])
            yield row

    def __len__(self) -> int:
        return len(self.prompt_token_ids)

    def __getitem__(self, index: int | slice
                    ) -> dict[int, Logprob] | None | list[dict[int, Logprob] | None]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        position = operator.index(index)
        position += len(self) if position < 0 else 0
        if not 0 <= position < len(self):
            raise IndexError(f"position {index} of a {len(self)}-token prompt")
        if not 1 <= position <= len(self.token_logprobs):
            return None  # position 0, or not arrived yet
        i = position - 1
        [entry] = self._maps([(self.prompt_token_ids[position], self.token_logprobs[i],
                               self.ranks[i], self.top_token_ids[i], self.top_logprobs[i])],
                             Logprob)
        return entry

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        if self.prompt_token_ids:
            yield None
        yield from self.maps()
        yield from repeat(None, len(self) - 1 - len(self.token_logprobs))

    def __eq__(self, other: object) -> bool:
        """Element-wise, with any Sequence (a list of vLLM's maps, say)."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return (f"<FlatPromptLogprobs: positions 1..{len(self.token_logprobs)} of a "
                f"{len(self)}-token prompt>")


class RequestMetrics(msgspec.Struct, gc=False):
    """Timestamps in time.monotonic() seconds, recorded inside the engine."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = msgspec.field(default_factory=list)
    finish_time: float | None = None
    num_cached_tokens: int = 0


class CompletionOutput(msgspec.Struct, gc=False):
    """One of the n choices. `text`/`token_ids`/`logprobs` are cumulative; `delta_*` what this
    step added. Text that may begin a stop string is withheld until known. With output_kind
    "delta" the cumulative fields (and metrics' token_times) stay empty until it finishes."""
    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = msgspec.field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_finish_reason = operator.attrgetter("finish_reason")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # all n choices, by index
    metrics: list[RequestMetrics]  # one per choice
    error: str | None = None  # set when the request failed inside the engine
    # set once every prompt position has them, then shared and never changed; None before
    prompt_logprobs: FlatPromptLogprobs | None = None
    finished: bool = field(init=False)  # every choice finished; read several times per step

    def __post_init__(self) -> None:
        self.finished = None not in map(_finish_reason, self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
