"""The engine core's grammars: compiled off the loop, one matcher per constrained sequence.

A sequence's matcher has taken exactly the output tokens the scheduler applied (`advance`),
so the mask it gives (`mask`) is that of the sequence's next token. The core asks for a
step's mask only once the step before it is applied (EngineCore.step), which is what keeps
this true while steps overlap on the device.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from engine.core.batch import GrammarMask, ScheduledSequence
from engine.core.request import VOCAB_SIZE, Request, StructuredOutputsParams
from engine.structured.grammar import compiler, grammar_of

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, by spec; a few MB at most
# below this many rows one thread fills the mask: a thread pool's hand-off costs more than
# the ~10 us a row takes
BATCH_FILL_ROWS = 32
# a JSON state can take ~100 us to fill; the core's loop is one thread, the others are idle
FILL_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) - 1))


class StructuredOutputs:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()  # spec key -> compile
        self._compiling: dict[str, Future] = {}  # seq id -> its grammar's compile
        self._matchers: dict[str, list] = {}  # seq id -> [GrammarMatcher, tokens accepted]
        self._batch = None  # xgrammar's BatchGrammarMatcher, on the first mask
        self.num_compiles = 0  # grammars compiled (cache misses)

    def submit(self, seq_id: str, spec: StructuredOutputsParams) -> None:
        """Start compiling `spec` (or share its cached compile) for the sequence."""
        future = self._compiled.get(spec.key)
        if future is None:
            future = self._executor.submit(_compile, spec)
            self.num_compiles += 1
            self._compiled[spec.key] = future
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec.key)
        self._compiling[seq_id] = future

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
                self._matchers[seq_id] = [xgr.GrammarMatcher(future.result()), 0]
            results.append((seq_id, None if error is None else str(error)))
        return results

    def mask(self, sequences: list[ScheduledSequence]) -> GrammarMask:
        """The bitmask of the step's constrained sampled rows. A row whose sequence has no
        live matcher (finished or aborted since it was scheduled, its token to be dropped)
        allows every token."""
        import xgrammar as xgr

        ids = [s.request_id for s in sequences if s.sample and s.params.structured_outputs]
        bitmask = xgr.allocate_token_bitmask(len(ids), VOCAB_SIZE)  # all ones
        live = [(row, self._matchers[i][0]) for row, i in enumerate(ids)
                if i in self._matchers and not self._matchers[i][0].is_terminated()]
        if len(live) < BATCH_FILL_ROWS:
            for row, matcher in live:
                matcher.fill_next_token_bitmask(bitmask, row)
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
            self._batch.batch_fill_next_token_bitmask([m for _, m in live], bitmask,
                                                      [row for row, _ in live])
        return GrammarMask(ids, bitmask.numpy())

    def advance(self, request: Request) -> bool:
        """Feed the matcher the request's output tokens it has not taken yet. True when the
        constraint is complete (or, never expected, refused a token): the request ends."""
        matcher, taken = self._matchers[request.request_id]
        for token in request.output_token_ids[taken:]:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token):
                log.warning("sequence %s: its grammar refused token %d; ending it",
                            request.request_id, token)
                return True
        self._matchers[request.request_id][1] = request.num_output_tokens
        return matcher.is_terminated()

    def release(self, seq_id: str) -> None:
        self._compiling.pop(seq_id, None)
        self._matchers.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._matchers


def _compile(spec: StructuredOutputsParams):
    return compiler().compile_grammar(grammar_of(spec))
