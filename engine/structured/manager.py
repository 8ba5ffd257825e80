"""The engine core's grammars: compiled off the loop, one matcher per constrained sequence.

A sequence's matcher has taken exactly the output tokens the core passed to `advance`, so the
mask `take_mask` gives is that of each row's next token. The core asks for a step's mask
(`request_mask`) only once the step before it is applied, which keeps this true while steps
overlap on the device. `StructuredOutputs` fills the mask when it is taken, on the caller's
thread; engine/structured/process.py runs them in child processes, so that the fill overlaps
the core's own work (xgrammar holds the GIL while it fills).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from engine.core.batch import GrammarMask
from engine.core.request import VOCAB_SIZE, StructuredOutputsParams
from engine.structured.grammar import compiler, grammar_of

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, by spec; a few MB at most
MASK_WORDS = -(-VOCAB_SIZE // 32)  # int32 words of a bitmask row
ALL_ALLOWED = -1  # an int32 word with every bit set


class StructuredOutputs:
    def __init__(self, max_rows: int, bitmask: np.ndarray | None = None) -> None:
        """`max_rows`: the most constrained rows a step samples; `bitmask`: int32
        [max_rows, MASK_WORDS] to fill masks into (default: a fresh array)."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()  # spec key -> compile
        self._compiling: dict[str, Future] = {}  # seq id -> its grammar's compile
        self._matchers: dict[str, object] = {}  # seq id -> xgrammar GrammarMatcher
        self._completed: set[str] = set()  # matchers complete (or refused) since take_mask
        self._bitmask = (np.empty((max_rows, MASK_WORDS), np.int32) if bitmask is None
                         else bitmask)
        self._rows: list[str] = []  # the sequences of the mask requested
        self._at: list[int] | None = None  # the bitmask rows they fill (None: 0, 1, ...)
        self.num_compiles = 0  # grammars compiled (cache misses)

    def submit(self, seq_id: str, spec: StructuredOutputsParams) -> None:
        """Start compiling `spec` (or share its cached compile) for the sequence."""
        self._compiling[seq_id] = self.precompile(spec)

    def precompile(self, spec: StructuredOutputsParams) -> Future:
        """Start compiling `spec` into the cache, unless it is there; its compile."""
        future = self._compiled.get(spec.key)
        if future is None:
            future = self._executor.submit(_compile, spec)
            self.num_compiles += 1
            self._compiled[spec.key] = future
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        return future

    def take_compiled(self, timeout: float = 0.0) -> list[tuple[str, str | None]]:
        """Sequences whose grammar is done (waiting up to `timeout` for the first): (seq id,
        None) now has a matcher; (seq id, message) could not be compiled."""
        if timeout > 0 and self._compiling:
            wait(set(self._compiling.values()), timeout, FIRST_COMPLETED)
        done = [(seq_id, f) for seq_id, f in self._compiling.items() if f.done()]
        results = []
        for seq_id, future in done:
            del self._compiling[seq_id]
            error = future.exception()
            if error is None:
                import xgrammar as xgr
                self._matchers[seq_id] = xgr.GrammarMatcher(future.result())
            results.append((seq_id, None if error is None else str(error)))
        return results

    def advance(self, seq_ids: list[str], tokens: list[int]) -> None:
        """Each sequence's matcher takes its one new output token (a step's constrained rows:
        they never have drafts). A constraint that completes (or, never expected, refuses a
        token) is reported by the next take_mask; a sequence without a matcher is skipped."""
        matchers = self._matchers
        for seq_id, token in zip(seq_ids, tokens):
            matcher = matchers.get(seq_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token):
                log.warning("sequence %s: its grammar refused token %d; ending it", seq_id, token)
                self._completed.add(seq_id)
            elif matcher.is_terminated():
                self._completed.add(seq_id)

    def request_mask(self, rows: list[str], at: list[int] | None = None) -> None:
        """Ask for the mask of these rows (sequence ids, in the step's order), into bitmask
        rows `at` (default 0, 1, ...: the mask take_mask returns)."""
        if max(at or [len(rows) - 1], default=-1) >= len(self._bitmask):
            raise ValueError(f"{len(rows)} constrained rows; this engine masks at most "
                             f"{len(self._bitmask)} a step")
        self._rows, self._at = rows, at

    def take_mask(self) -> tuple[GrammarMask, list[str]]:
        """The requested mask, and the sequences whose constraint completed since the last
        take_mask (the core ends them). A row whose sequence has no live matcher (finished or
        aborted since it was scheduled, its token to be dropped) allows every token. The
        mask's array is this object's, valid until the next take_mask."""
        import torch

        rows, at = self._rows, self._at or range(len(self._rows))
        self._rows, self._at = [], None
        tensor = torch.from_numpy(self._bitmask)  # xgrammar fills torch tensors; shared memory
        for row, seq_id in zip(at, rows):
            matcher = self._matchers.get(seq_id)
            if matcher is None or matcher.is_terminated():
                self._bitmask[row] = ALL_ALLOWED
            else:
                matcher.fill_next_token_bitmask(tensor, row)
        completed = sorted(self._completed)
        self._completed.clear()
        return GrammarMask(rows, self._bitmask[:len(rows)]), completed

    def release(self, seq_id: str) -> None:
        self._compiling.pop(seq_id, None)
        self._matchers.pop(seq_id, None)
        self._completed.discard(seq_id)


def _compile(spec: StructuredOutputsParams):
    return compiler().compile_grammar(grammar_of(spec))
