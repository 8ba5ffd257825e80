"""Host-side input preparation: a step's ScheduledSequences become flat arrays (HostInputs),
then device tensors plus attention metadata (StepInputs). Decode steps that replay CUDA graphs
take the HostInputs straight into the graphs' static buffers.

    seqs        A: 3 new tokens at positions 5..7     B: 1 new token at position 12
    token_ids   [a5 a6 a7 b12]         positions    [5 6 7 12]
    query_start [0 3 4]                seq_lens     [8 13]
    slot        block_ids[p // block_size] * block_size + p % block_size, per token
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.attention import AttentionMetadata
from engine.core.batch import ScheduledSequence


@dataclass
class HostInputs:
    """One step's inputs as host arrays, varlen over the batch."""
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, max_blocks_per_seq]
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]
    sample_indices: np.ndarray  # int64: the last token row of each sample=True sequence
    max_query_len: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num sample=True seqs] int64: each one's last token row


def is_decode_step(seqs: list[ScheduledSequence]) -> bool:
    """One new token per sequence and every sequence samples (a 1-token prompt chunk that
    does not reach the end of its prompt is not a decode)."""
    return all(len(s.token_ids) == 1 and s.sample for s in seqs)


def prepare_host_inputs(seqs: list[ScheduledSequence], block_size: int,
                        max_blocks_per_seq: int) -> HostInputs:
    """Varlen inputs of one step, computed with numpy over the whole batch at once."""
    if is_decode_step(seqs):
        return _decode_host_inputs(seqs, block_size, max_blocks_per_seq)
    new_lens = np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
    starts = np.array([s.start_position for s in seqs], dtype=np.int64)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(new_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(len(seqs)), new_lens)
    positions = starts[seq_of_token] + np.arange(num_tokens) - query_start_loc[seq_of_token]
    block_tables = _block_table_array(seqs, max_blocks_per_seq)
    block_of_token = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                            dtype=np.int64, count=num_tokens)
    return HostInputs(
        token_ids=token_ids, positions=positions,
        slot_mapping=block_of_token * block_size + positions % block_size,
        block_tables=block_tables, seq_lens=(starts + new_lens).astype(np.int32),
        query_start_loc=query_start_loc.astype(np.int32),
        sample_indices=(query_start_loc[1:] - 1)[[s.sample for s in seqs]],
        max_query_len=int(new_lens.max()))


def _block_table_array(seqs: list[ScheduledSequence], width: int) -> np.ndarray:
    """Ragged block ids as a zero-padded [S, width] array (a row loop measured faster than
    building one flat array and scattering it)."""
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for row, s in enumerate(seqs):
        table[row, :len(s.block_ids)] = s.block_ids
    return table


def _decode_host_inputs(seqs: list[ScheduledSequence], block_size: int,
                        max_blocks_per_seq: int) -> HostInputs:
    """The common decode step (one token per sequence, all sampling), with plain lists: one
    token per sequence needs none of the varlen index arithmetic, whose numpy call overheads
    dominate at decode batch sizes."""
    positions = [s.start_position for s in seqs]
    slots = [s.block_ids[p // block_size] * block_size + p % block_size
             for s, p in zip(seqs, positions)]
    rows = np.arange(len(seqs), dtype=np.int64)
    return HostInputs(
        token_ids=np.array([s.token_ids[0] for s in seqs], dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=_block_table_array(seqs, max_blocks_per_seq),
        seq_lens=np.array(positions, dtype=np.int32) + 1,
        query_start_loc=np.arange(len(seqs) + 1, dtype=np.int32),
        sample_indices=rows, max_query_len=1)


PADDING_ROW = (0,)  # a padding row attends to position 0 of block 0 (the cache is zeroed)


class DecodeStager:
    """Writes decode steps (one token per sequence) straight into fixed host arrays, the CUDA
    graphs' pinned staging buffers, for a padded batch of `size` rows:

        ids64 [7, n]         (row 0: filled on the device) | token ids | positions |
                             slot mapping | token source | draw seed | draw temperature
                             (float64 bits)
                             padding: 0 | 0 | -1 | n + row | 0 | 0 (greedy: no noise)
        ids32 [n + n * W]    seq_lens (padding: 1) | block tables [n, W] (padding: block 0)

    The token source of row r is n + r (its own token id, row 1) for a known token, or
    sources[r] (row 0: the previous step's sampled tokens) for a placeholder.

    A block-table row is rewritten only when the blocks it holds differ from the sequence's
    (a sequence gains a block every block_size tokens; rows shift when the batch changes),
    compared as tuples (what the scheduler sends), so a typical step writes no table row at
    all. Entries past a row's blocks may be stale: the kernels read a table only below the
    sequence's length."""

    def __init__(self, ids64: np.ndarray, ids32: np.ndarray, max_blocks_per_seq: int,
                 block_size: int):
        self.ids64, self.block_size = ids64, block_size
        n = ids64.shape[1]
        self.seq_lens = ids32[:n]
        self.tables = ids32[n:].reshape(n, max_blocks_per_seq)
        self._rows: list[tuple[int, ...] | None] = [None] * n  # what each table row holds

    def write(self, seqs: list[ScheduledSequence], size: int, sources: list[int],
              draw_inputs: tuple[np.ndarray, np.ndarray]) -> None:
        """Only the per-sequence reads are Python; the arithmetic is numpy over the batch.
        `draw_inputs`: each row's temperature and noise seed (Sampler.draw_inputs)."""
        batch, bs, n = len(seqs), self.block_size, self.ids64.shape[1]
        self._write_tables(seqs, size)
        token_ids, positions, slots, token_source = self.ids64[1:5, :batch]
        token_ids[:] = [s.token_ids[0] for s in seqs]
        np.maximum(token_ids, 0, out=token_ids)  # a placeholder's id is read from row 0
        positions[:] = [s.start_position for s in seqs]
        rows = np.arange(batch)
        slots[:] = self.tables[rows, positions // bs] * bs + positions % bs
        token_source[:] = sources
        np.copyto(token_source, rows + n, where=token_source < 0)
        self.ids64[1:4, batch:size] = ((0,), (0,), (-1,))
        self.ids64[4, batch:size] = range(n + batch, n + size)
        stage_draw_inputs(self.ids64, draw_inputs, size)
        self.seq_lens[:batch] = positions + 1
        self.seq_lens[batch:size] = 1

    def _write_tables(self, seqs: list[ScheduledSequence], size: int) -> None:
        """The rows whose blocks changed (see the class docstring), then the padding rows."""
        for row, s in enumerate(seqs):
            if self._rows[row] != s.block_ids:
                self.tables[row, :len(s.block_ids)] = s.block_ids
                self._rows[row] = tuple(s.block_ids)  # no copy of the scheduler's tuple
        for row in range(len(seqs), size):
            if self._rows[row] != PADDING_ROW:
                self.tables[row, 0] = 0
                self._rows[row] = PADDING_ROW


class MixedStager:
    """Writes a step with prompt tokens (HostInputs) into the mixed-step graphs' staging
    arrays, padded to `size` tokens and `rows` sequences (engine.worker.cuda_graphs):

        ids64 [7, n]    as DecodeStager's; token rows padded with (0, 0, -1, own token);
                        draw rows hold the sampling sequences' seeds and temperatures
                        (padding: 0, greedy)
        ids32           query_start_loc [S+1] (padding: T) | seq_lens [S] (padding: 0) |
                        sample rows [S] (padding: 0) | block tables [S, W]

    (S here is the graphs' max_num_seqs; `layout` gives each segment's range.)"""

    def __init__(self, ids64: np.ndarray, ids32: np.ndarray, max_num_seqs: int,
                 max_blocks_per_seq: int):
        self.ids64 = ids64
        (self.query_start_loc, self.seq_lens, self.sample_rows,
         self.tables) = self.segments(ids32, max_num_seqs, max_blocks_per_seq)

    @staticmethod
    def layout(max_num_seqs: int, max_blocks_per_seq: int) -> dict[str, tuple[int, int]]:
        """Each ids32 segment's (start, end)."""
        sizes = {"query_start_loc": max_num_seqs + 1, "seq_lens": max_num_seqs,
                 "sample_rows": max_num_seqs, "tables": max_num_seqs * max_blocks_per_seq}
        ends = np.cumsum(list(sizes.values())).tolist()
        return {name: (end - size, end) for (name, size), end in zip(sizes.items(), ends)}

    @classmethod
    def segments(cls, ids32, max_num_seqs: int, max_blocks_per_seq: int) -> tuple:
        """Views of ids32 (a numpy array here, the graphs' device tensor there): query start
        locations, seq_lens, sample rows, block tables [max_num_seqs, W]."""
        (q, s, r, t) = (ids32[start:end] for start, end
                        in cls.layout(max_num_seqs, max_blocks_per_seq).values())
        return q, s, r, t.reshape(max_num_seqs, max_blocks_per_seq)

    def write(self, host: HostInputs, sources: list[int],
              draw_inputs: tuple[np.ndarray, np.ndarray], size: int, rows: int) -> None:
        """`sources[s]` >= 0: sequence s's one new token is a placeholder, row sources[s] of
        the previous step's samples (see DecodeStager)."""
        n = self.ids64.shape[1]
        tokens, seqs, samples = len(host.token_ids), len(host.seq_lens), len(host.sample_indices)
        token_ids, positions, slots, token_source = self.ids64[1:5]
        np.maximum(host.token_ids, 0, out=token_ids[:tokens])  # placeholders come from row 0
        positions[:tokens] = host.positions
        slots[:tokens] = host.slot_mapping
        token_source[:size] = np.arange(n, n + size)
        sources = np.asarray(sources)
        placeholders = np.flatnonzero(sources >= 0)
        token_source[host.query_start_loc[placeholders]] = sources[placeholders]
        self.ids64[1:4, tokens:size] = ((0,), (0,), (-1,))
        stage_draw_inputs(self.ids64, draw_inputs, rows)
        self.query_start_loc[:seqs + 1] = host.query_start_loc
        self.query_start_loc[seqs + 1:rows + 1] = tokens
        self.seq_lens[:seqs] = host.seq_lens
        self.seq_lens[seqs:rows] = 0
        self.sample_rows[:samples] = host.sample_indices
        self.sample_rows[samples:rows] = 0
        self.tables[:seqs] = host.block_tables


def stage_draw_inputs(ids64: np.ndarray, draw_inputs: tuple[np.ndarray, np.ndarray],
                      rows: int) -> None:
    """Rows 5-6 of a graph's int64 staging: each sampling row's seed and temperature
    (float64 bits), then greedy padding (all zero bits: seed 0, temperature 0.0) up to
    `rows`."""
    temperature, seeds = draw_inputs
    samples = len(seeds)
    ids64[5, :samples] = seeds
    ids64[6, :samples].view(np.float64)[:] = temperature
    ids64[5:, samples:rows] = 0


def upload(array: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host array to device without waiting: through pinned memory on CUDA, since a copy from
    pageable memory first waits for all work queued on the device (the step in flight)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if device.type == "cuda":
        host = host.pin_memory()  # cached by torch's host allocator until the copy is done
    return host.to(device, non_blocking=True)


def to_device(host: HostInputs, device: torch.device) -> StepInputs:
    def on_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(array, dtype, device)

    meta = AttentionMetadata(
        slot_mapping=on_device(host.slot_mapping, torch.int64),
        block_tables=on_device(host.block_tables, torch.int32),
        seq_lens=on_device(host.seq_lens, torch.int32),
        query_start_loc=on_device(host.query_start_loc, torch.int32),
        max_query_len=host.max_query_len, max_seq_len=int(host.seq_lens.max()),
        query_start_loc_host=host.query_start_loc.tolist(), seq_lens_host=host.seq_lens.tolist())
    return StepInputs(on_device(host.token_ids, torch.int64),
                      on_device(host.positions, torch.int64), meta,
                      on_device(host.sample_indices, torch.int64))
