"""A step's logprobs (Sampler._with_logprobs) replayed from CUDA graphs: one per power-of-two
row count up to the step's most sampled rows and per top-k width (WIDTHS), each running
`token_logprobs` at k = that width over static buffers. A step then costs the host a gather of
its rows' logits and tokens and one replay, instead of the kernel's launch (Triton's launcher
takes ~0.13 ms of host time on the H100 node) and its allocations.

    logits[rows], tokens[rows]                 ─gather─▶  logits[:R], tokens[:R]
    graph[size, width]: token_logprobs(logits[:size], tokens[:size], width) ─▶ outputs

A step whose first R rows all ask for logprobs, over a graph's StepOutputs (a beam search's
steps, say), skips the gather: a second graph per size and width reads the StepOutputs' rows
in place.
Rows R..size-1 compute from whatever their buffers hold last: results nobody reads.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.request import MAX_LOGPROBS
from engine.worker.cuda_graphs.graph_set import StepOutputs, capture_graph
from engine.worker.cuda_graphs.plan import power_of_two_sizes

# top-k widths captured: the kernel's time grows with k, and the narrower serves beam searches
# of up to 4 beams (2B candidates a step) and most logprobs requests
WIDTHS = (8, MAX_LOGPROBS)


class LogprobGraphs:
    def __init__(self, token_logprobs: Callable, step: StepOutputs, dtype: torch.dtype,
                 max_rows: int, device: torch.device) -> None:
        self.sizes = power_of_two_sizes(max_rows)
        top = self.sizes[-1]
        self._op = token_logprobs
        self.step = step
        self._logits = torch.zeros(top, step.vocab, dtype=dtype, device=device)
        self._tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self.keys = [(in_place, size, width) for in_place in (False, True)
                     for size in self.sizes for width in WIDTHS]
        self.graphs: dict[tuple[bool, int, int], torch.cuda.CUDAGraph] = {}  # by key
        self.outputs: dict[tuple[bool, int, int], tuple[torch.Tensor, ...]] = {}
        self.steps_in_place = 0  # runs that read the StepOutputs in place

    def capture(self, pool=None):
        """Every key's graph, in `pool` (None: a new one); returns the pool."""
        for key in self.keys:
            self.graphs[key], pool, self.outputs[key] = capture_graph(
                lambda: self.record(*key), pool)
        return pool

    def record(self, in_place: bool, size: int, width: int) -> tuple[torch.Tensor, ...]:
        """What the graph for `size` rows and top `width` runs, over the StepOutputs if
        `in_place`."""
        if in_place:
            logits, tokens = self.step.logits[:size, :self.step.vocab], self.step.drawn[:size]
        else:
            logits, tokens = self._logits[:size], self._tokens[:size]
        return self._op(logits, None, tokens, width)

    def takes(self, logits: torch.Tensor, num_rows: int) -> bool:
        """Whether `run` serves these logits: the graphs' dtype, at most their rows."""
        return logits.dtype == self._logits.dtype and num_rows <= self.sizes[-1]

    def run(self, logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_logprobs(logits, rows, tokens, k) of Ops, except that the top logprobs and
        ids come a WIDTHS width >= k wide (their first k columns are the answer): views of the
        graphs' outputs, valid until the next run."""
        count = logits.shape[0] if rows is None else rows.shape[0]
        size = next(s for s in self.sizes if s >= count)
        width = next(w for w in WIDTHS if w >= k)
        in_place = rows is None and self.step.holds(logits, tokens)
        if in_place:
            self.steps_in_place += 1
        elif rows is None:
            self._logits[:count].copy_(logits)
            self._tokens[:count].copy_(tokens)
        else:
            torch.index_select(logits, 0, rows, out=self._logits[:count])
            torch.index_select(tokens, 0, rows, out=self._tokens[:count])
        self.graphs[in_place, size, width].replay()
        return tuple(out[:count] for out in self.outputs[in_place, size, width])
