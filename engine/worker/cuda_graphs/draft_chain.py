"""The draft model's greedy decode iterations, chained on the device: `greedy_chain`, and
`DraftChainGraphs`, which captures it once per padded batch size for k iterations, so a
step's drafting costs one graph launch instead of k.

    iteration   0          1          2          3          (k = 4; a row with 4 drafts,
    feeds       t19 @19    d1 @20     d2 @21     d3 @22      last known token t19 at 19)
    draws       d1         d2         d3         d4         iteration i + 1 feeds i's draw
    writes      KV @19     KV @20     KV @21     KV @22     the draft's, in the row's slots

A row with d < k drafts repeats its last position in the later iterations without writing
(slot -1), and its drafts after the d-th are NO_TOKEN; a row with none writes nothing. Each
iteration's slots and lengths come from the rows' positions and block tables on the device.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from engine.core.batch import ScheduledSequence
from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.buffers import BufferLayout
from engine.worker.cuda_graphs.decode import DecodeStager, OneTokenGraphs
from engine.worker.spec_verify import NO_TOKEN

Draw = Callable[[torch.Tensor], torch.Tensor]  # hidden states [B, D] -> greedy tokens [B]


def greedy_chain(model: torch.nn.Module, kv_caches: list, input_ids: torch.Tensor,
                 positions: torch.Tensor, meta: AttentionMetadata, draft_counts: torch.Tensor,
                 iterations: int, draw: Draw) -> torch.Tensor:
    """`iterations` greedy decode steps of `model` from each row's token `input_ids` at
    `positions` (one token a row; `meta`: their block tables, query starts and longest
    length), the row drafting draft_counts[row] tokens (see the module docstring). Returns
    int64 [rows, iterations], NO_TOKEN past a row's count."""
    counts = draft_counts.long()
    block_size = kv_caches[0][0].shape[1]
    last = positions + (counts - 1).clamp(min=0)
    columns = []
    for i in range(iterations):
        at = torch.minimum(positions + i, last)
        blocks = meta.block_tables.gather(1, (at // block_size)[:, None]).squeeze(1)
        slots = torch.where(counts > i, blocks * block_size + at % block_size, -1)
        step_meta = replace(meta, slot_mapping=slots, seq_lens=(at + 1).int(),
                            max_seq_len=meta.max_seq_len + i, seq_lens_host=None)
        input_ids = draw(model(input_ids, at, kv_caches, step_meta))
        columns.append(input_ids.masked_fill(counts <= i, NO_TOKEN))
    return torch.stack(columns, dim=1)


def chain_meta_layout(max_batch: int, max_blocks_per_seq: int) -> BufferLayout:
    """The decode layout (what DecodeStager writes) and each row's draft count."""
    return BufferLayout(seq_lens=max_batch, draft_counts=max_batch,
                        block_tables=(max_batch, max_blocks_per_seq))


class DraftChainGraphs(OneTokenGraphs):
    """greedy_chain over `iterations` steps, one graph per padded batch size."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device, iterations: int):
        super().__init__(model, kv_caches, max_num_seqs, max_model_len, device,
                         lambda rows: chain_meta_layout(rows, max_blocks_per_seq),
                         lambda tokens, meta: DraftChainStager(tokens, meta, block_size))
        self.iterations = iterations

    def forward(self, size: int) -> torch.Tensor:
        input_ids, positions = self._inputs(size)
        return greedy_chain(self.model, self.kv_caches, input_ids, positions,
                            self.attention_meta(size), self.meta.draft_counts[:size],
                            self.iterations, lambda hidden: self._logits_and_draws(hidden)[1])

    def run(self, rows: list[ScheduledSequence], draft_counts: list[int]) -> torch.Tensor:
        """Replay the graph for these rows (each its last known token at its position) and
        counts; returns their drafts [len(rows), iterations], valid until the next replay."""
        size = self.size_for(len(rows))
        self._replay(size, lambda stager: stager.write_chain(rows, draft_counts, size), None,
                     size)
        return self.outputs[size][:len(rows)]


class DraftChainStager(DecodeStager):
    """A decode step of the rows, drawn greedily, and each row's draft count (0: padding)."""

    def write_chain(self, rows: list[ScheduledSequence], draft_counts: list[int],
                    size: int) -> None:
        batch = len(rows)
        self.write(rows, size, [-1] * batch, (np.zeros(batch), np.zeros(batch, np.int64)))
        self.meta.draft_counts[:batch] = draft_counts
        self.meta.draft_counts[batch:size] = 0
