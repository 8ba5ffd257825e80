"""A step's logprobs (Sampler._with_logprobs) replayed from CUDA graphs: one per power-of-two
row count up to the step's most sampled rows, each running `token_logprobs` at k =
MAX_LOGPROBS over static buffers. A step then costs the host a gather of its rows' logits and
tokens and one replay, instead of the kernel's launch (Triton's launcher takes ~0.13 ms of
host time on the H100 node) and its allocations.

    logits[rows], tokens[rows]                 ─gather─▶  logits[:R], tokens[:R]
    graph[size]: token_logprobs(logits[:size], tokens[:size], MAX_LOGPROBS) ─▶ outputs[size]

Rows R..size-1 compute from whatever their buffers hold last: results nobody reads.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.request import MAX_LOGPROBS
from engine.worker.cuda_graphs.graph_set import capture_graph
from engine.worker.cuda_graphs.plan import power_of_two_sizes


class LogprobGraphs:
    def __init__(self, token_logprobs: Callable, vocab: int, dtype: torch.dtype, max_rows: int,
                 device: torch.device) -> None:
        self.sizes = power_of_two_sizes(max_rows)
        top = self.sizes[-1]
        self._op = token_logprobs
        self._logits = torch.zeros(top, vocab, dtype=dtype, device=device)
        self._tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def capture(self, pool=None):
        """Every size's graph, in `pool` (None: a new one); returns the pool."""
        for size in self.sizes:
            self._graphs[size], pool, self._outputs[size] = capture_graph(
                lambda: self._op(self._logits[:size], None, self._tokens[:size], MAX_LOGPROBS),
                pool)
        return pool

    def takes(self, logits: torch.Tensor, num_rows: int) -> bool:
        """Whether `run` serves these logits: the graphs' dtype, at most their rows."""
        return logits.dtype == self._logits.dtype and num_rows <= self.sizes[-1]

    def run(self, logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor,
            k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """token_logprobs(logits, rows, tokens, k) of Ops, except that the top logprobs and
        ids come MAX_LOGPROBS wide (their first k columns are the answer): views of the
        graphs' outputs, valid until the next run."""
        count = logits.shape[0] if rows is None else rows.shape[0]
        size = next(s for s in self.sizes if s >= count)
        if rows is None:
            self._logits[:count].copy_(logits)
            self._tokens[:count].copy_(tokens)
        else:
            torch.index_select(logits, 0, rows, out=self._logits[:count])
            torch.index_select(tokens, 0, rows, out=self._tokens[:count])
        self._graphs[size].replay()
        return tuple(out[:count] for out in self._outputs[size])
