"""The masked draw of a step's constrained rows (Sampler._masked_draw), replayed from CUDA
graphs over the step graphs' StepOutputs: one graph per power-of-two row count up to the
step's most sampled rows. A step then costs the host two copies and one replay, instead of
the kernel's launch (Triton's launcher takes ~0.13 ms of host time on the H100 node) and
three fresh uploads:

    staging (pinned)  rows | seeds | temperature bits      ─copy─▶  inputs (device)
    grammar mask (page-locked, the grammars')              ─copy─▶  words[:R]
    graph[size]: masked_draw(step logits, inputs rows, words[:size], ...) ─▶ step draws[rows]

Rows R..size-1 name the StepOutputs' spare row: their draws land where no step reads.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.worker.cuda_graphs.graph_set import StepOutputs, capture_graph
from engine.worker.cuda_graphs.plan import power_of_two_sizes


class MaskedDrawGraphs:
    def __init__(self, masked_draw: Callable, step: StepOutputs, words: int, max_rows: int,
                 device: torch.device) -> None:
        """`masked_draw`: Ops.masked_sample; `words`: int32 words of a bitmask row;
        `max_rows`: the most constrained rows a step samples."""
        self.sizes = power_of_two_sizes(max_rows)
        top = self.sizes[-1]
        self.step = step
        self._draw = masked_draw
        pin = device.type == "cuda"
        self._staging = torch.zeros(3, top, dtype=torch.int64, pin_memory=pin)
        self._staging[0] = step.spare_row  # rows past a step's count stay there
        self._inputs = self._staging.to(device)
        self._words = torch.zeros(top, words, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, pool=None):
        """Every size's graph, in `pool` (None: a new one); returns the pool."""
        for size in self.sizes:
            self.graphs[size], pool, _ = capture_graph(lambda: self.record(size), pool)
        return pool

    def record(self, size: int) -> None:
        """What the graph for `size` rows runs."""
        temperature = self._inputs[2, :size].view(torch.float64)
        self._draw(self.step.logits[:, :self.step.vocab], self._inputs[0, :size],
                   self._words[:size], temperature, self._inputs[1, :size], self.step.drawn)

    def takes(self, logits: torch.Tensor, drawn: torch.Tensor, count: int) -> bool:
        """Whether `run` serves a step with these logits and draws (a graph set's, in the
        StepOutputs) and `count` constrained rows."""
        return count <= self.sizes[-1] and self.step.holds(logits, drawn)

    def run(self, rows: np.ndarray, words: np.ndarray, temperature: np.ndarray,
            seeds: np.ndarray) -> None:
        """The step's draws[rows[r]] become the draw of its logits row rows[r] over the
        tokens words[r] allows, at temperature[r] and seeds[r]: what `masked_draw` gives, in
        place. `words` may be page-locked; it must stay unchanged until the step's tokens
        are waited for."""
        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging
        staging = self._staging.numpy()
        staging[0, :count] = rows
        staging[0, count:size] = self.step.spare_row
        staging[1, :count] = seeds
        staging[2, :count] = temperature.astype(np.float64).view(np.int64)
        self._inputs.copy_(self._staging, non_blocking=True)  # whole: one contiguous copy
        if self._copied is not None:
            self._copied.record()
        self._words[:count].copy_(torch.from_numpy(words), non_blocking=True)
        self.graphs[size].replay()
