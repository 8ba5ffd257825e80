"""The masked draw of a step's constrained rows (Sampler._masked_draw), replayed from CUDA
graphs: one per power-of-two row count up to the step's most sampled rows. A step then costs
the host two copies from pinned staging, a gather, one replay and a scatter, instead of the
kernel's launch and three fresh uploads.

    staging (pinned)  rows | seeds | temperature bits      ─copy─▶  inputs (device)
    grammar mask (page-locked, the grammars')              ─copy─▶  words[:R]
    logits[rows]                                         ─gather─▶  logits[:R]
    graph[size]: masked_draw(logits[:size], arange, words[:size], ...) ─▶ tokens[:size]
    drawn[rows] = tokens[:R]

Rows R..size-1 draw from whatever their buffers hold last: tokens nobody reads.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.worker.cuda_graphs.graph_set import capture_graph
from engine.worker.cuda_graphs.plan import power_of_two_sizes


class MaskedDrawGraphs:
    def __init__(self, masked_draw: Callable, vocab: int, words: int, dtype: torch.dtype,
                 max_rows: int, device: torch.device) -> None:
        self.sizes = power_of_two_sizes(max_rows)
        top = self.sizes[-1]
        self._draw = masked_draw
        self._staging = torch.zeros(3, top, dtype=torch.int64).pin_memory()
        self._inputs = torch.zeros(3, top, dtype=torch.int64, device=device)
        self._arange = torch.arange(top, device=device)
        self._logits = torch.zeros(top, vocab, dtype=dtype, device=device)
        self._words = torch.zeros(top, words, dtype=torch.int32, device=device)
        self._tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, pool=None):
        """Every size's graph, in `pool` (None: a new one); returns the pool."""
        for size in self.sizes:
            self._graphs[size], pool, _ = capture_graph(lambda: self._record(size), pool)
        return pool

    def _record(self, size: int) -> None:
        temperature = self._inputs[2, :size].view(torch.float64)
        self._draw(self._logits[:size], self._arange[:size], self._words[:size], temperature,
                   self._inputs[1, :size], self._tokens)

    def run(self, logits: torch.Tensor, rows: np.ndarray, words: np.ndarray,
            temperature: np.ndarray, seeds: np.ndarray, drawn: torch.Tensor) -> None:
        """drawn[rows[r]] = the draw of logits[rows[r]] over the tokens words[r] allows, at
        temperature[r] and seeds[r]: what `masked_draw` gives, in place. `words` may be
        page-locked; it must stay unchanged until the step's tokens are waited for."""
        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        self._copied.synchronize()  # the last step's copy has left the staging
        staging = self._staging.numpy()
        staging[0, :count] = rows
        staging[1, :count] = seeds
        staging[2, :count] = temperature.astype(np.float64).view(np.int64)
        self._inputs.copy_(self._staging, non_blocking=True)  # whole: one contiguous copy
        self._copied.record()
        self._words[:count].copy_(torch.from_numpy(words), non_blocking=True)
        on_device = self._inputs[0, :count]
        torch.index_select(logits, 0, on_device, out=self._logits[:count])
        self._graphs[size].replay()
        drawn.index_copy_(0, on_device, self._tokens[:count])
