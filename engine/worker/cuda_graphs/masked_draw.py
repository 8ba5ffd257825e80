"""The masked draw of a step's constrained rows (Sampler._masked_draw), replayed from CUDA
graphs over the step graphs' StepOutputs: one graph per power-of-two row count up to the
step's most sampled rows, for each of two places its inputs come from:

- a decode step's, staged at its launch (`stage`) into the decode graphs' `masked_draw`
  segment and copied in with its other inputs (`staged_inputs`): the draw then costs the host
  the mask's copy and one replay (`run_staged`);
- any other step's (`run`): a copy from the graphs' own pinned mirror too.

    staged    rows | seeds | temperature bits  (int64 [3, top])  ─copy─▶  inputs (device)
    grammar mask (page-locked, the grammars')                    ─copy─▶  words[:R]
    graph[size]: masked_draw(step logits, inputs rows, words[:size], ...) ─▶ step draws[rows]

Each replaces the kernel's launch (Triton's launcher takes ~0.13 ms of host time on the H100
node) and three fresh uploads. Rows R..size-1 name the StepOutputs' spare row: their draws
land where no step reads.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.worker.cuda_graphs.graph_set import StepOutputs, capture_graph
from engine.worker.cuda_graphs.plan import power_of_two_sizes


class MaskedDrawGraphs:
    def __init__(self, masked_draw: Callable, step: StepOutputs, words: int, max_rows: int,
                 device: torch.device, staged_inputs: torch.Tensor | None = None) -> None:
        """`masked_draw`: Ops.masked_sample; `words`: int32 words of a bitmask row;
        `max_rows`: the most constrained rows a step samples; `staged_inputs`: the device
        segment [3, rows_for(max_rows)] a decode step's inputs are staged into, if any."""
        self.sizes = power_of_two_sizes(max_rows)
        top = self.sizes[-1]
        self.step = step
        self._draw = masked_draw
        pin = device.type == "cuda"
        self._staging = torch.zeros(3, top, dtype=torch.int64, pin_memory=pin)
        self._staging[0] = step.spare_row  # rows past a step's count stay there
        self._inputs = self._staging.to(device)
        self._staged_inputs = staged_inputs
        self._words = torch.zeros(top, words, dtype=torch.int32, device=device)
        self._copied = torch.cuda.Event() if pin else None
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}  # (staged, size)
        self.steps_staged = 0  # draws whose inputs came in with a decode step's

    @staticmethod
    def rows_for(max_rows: int) -> int:
        """The rows of the inputs' layout for steps of at most max_rows constrained rows."""
        return power_of_two_sizes(max_rows)[-1]

    def capture(self, pool=None):
        """Every size's graph (and its staged twin), in `pool` (None: a new one); returns the
        pool."""
        for staged in (False, True) if self._staged_inputs is not None else (False,):
            for size in self.sizes:
                self.graphs[staged, size], pool, _ = capture_graph(
                    lambda: self.record(size, staged), pool)
        return pool

    def record(self, size: int, staged: bool = False) -> None:
        """What the graph for `size` rows runs, reading the staged segment if `staged`."""
        inputs = self._staged_inputs if staged else self._inputs
        temperature = inputs[2, :size].view(torch.float64)
        self._draw(self.step.logits[:, :self.step.vocab], inputs[0, :size], self._words[:size],
                   temperature, inputs[1, :size], self.step.drawn)

    def reads(self, inputs: torch.Tensor | None) -> bool:
        """Whether staged twins were captured over this segment (`run_staged` serves it)."""
        return inputs is not None and inputs is self._staged_inputs

    def takes(self, logits: torch.Tensor, drawn: torch.Tensor, count: int) -> bool:
        """Whether `run` serves a step with these logits and draws (a graph set's, in the
        StepOutputs) and `count` constrained rows."""
        return count <= self.sizes[-1] and self.step.holds(logits, drawn)

    def stage(self, inputs: np.ndarray, rows: np.ndarray, temperature: np.ndarray,
              seeds: np.ndarray) -> None:
        """Write the draw's inputs (`run`'s but the mask) into a layout [3, top] (the graphs'
        own mirror, or a decode step's segment), rows past their count the spare row."""
        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        inputs[0, :count] = rows
        inputs[0, count:size] = self.step.spare_row
        inputs[1, :count] = seeds
        inputs[2, :count] = temperature.astype(np.float64).view(np.int64)

    def run(self, rows: np.ndarray, words: np.ndarray, temperature: np.ndarray,
            seeds: np.ndarray) -> None:
        """The step's draws[rows[r]] become the draw of its logits row rows[r] over the
        tokens words[r] allows, at temperature[r] and seeds[r]: what `masked_draw` gives, in
        place. `words` may be page-locked; it must stay unchanged until the step's tokens
        are waited for."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging
        self.stage(self._staging.numpy(), rows, temperature, seeds)
        self._inputs.copy_(self._staging, non_blocking=True)  # whole: one contiguous copy
        if self._copied is not None:
            self._copied.record()
        self._replay(False, words)

    def run_staged(self, words: np.ndarray) -> None:
        """`run` for a step whose other inputs were staged (`stage`) into the decode graphs'
        segment and copied in with its inputs; `words` holds one row per constrained row."""
        self.steps_staged += 1
        self._replay(True, words)

    def _replay(self, staged: bool, words: np.ndarray) -> None:
        count = len(words)
        self._words[:count].copy_(torch.from_numpy(words), non_blocking=True)
        self.graphs[staged, next(s for s in self.sizes if s >= count)].replay()
