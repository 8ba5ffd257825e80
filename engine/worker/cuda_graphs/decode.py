"""Decode graphs (one token per sequence, per padded batch size) and their stager. A step of
B sequences replays the smallest captured size >= B; rows B.. are harmless padding:

    row        0    1    2    3    4  | 5    6    7        (B = 5, graph for 8)
    slot       s0   s1   s2   s3   s4 | -1   -1   -1       -1: KV store skips the row
    seq_len    c0   c1   c2   c3   c4 | 1    1    1        attends to block 0, slot 0
    block row  ...                    | 0 0 0 ...         (finite: the cache is zeroed)

Attention metadata is fixed at capture, max_seq_len the context length; kernels mask by seq_lens.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, NamedTuple

import numpy as np
import torch

from engine.core.batch import ScheduledSequence
from engine.worker.attention import AttentionMetadata
from engine.worker.block_copy import kv_storage
from engine.worker.cuda_graphs.block_copy_graph import BlockCopyGraph, stage_pairs
from engine.worker.cuda_graphs.buffers import BufferLayout, stage_draw_inputs
from engine.worker.cuda_graphs.graph_set import Follower, GraphSet, MakeStager, StepOutputs
from engine.worker.sampler import DrawInputs

PADDING_ROW = (0,)  # a padding row attends to position 0 of block 0 (the cache is zeroed)


class Continued(NamedTuple):
    """A decode step whose row i continues row src[i] of the step staged just before, one
    position on (DecodeStager.write_continued). new_table(row, table): the block table of a
    row whose new position starts a block, given the table it continues."""
    src: np.ndarray  # int64 [rows]
    new_table: Callable[[int, tuple[int, ...]], tuple[int, ...]]


def decode_meta_layout(max_batch: int, max_blocks_per_seq: int) -> BufferLayout:
    return BufferLayout(seq_lens=max_batch, block_tables=(max_batch, max_blocks_per_seq))


class OneTokenGraphs(GraphSet):
    """A graph set whose rows hold one token each, per padded batch size (`sizes`, ascending):
    decode attention metadata over a meta buffer with `seq_lens` and `block_tables`."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: tuple[int, ...],
                 max_model_len: int, device: torch.device,
                 meta_layout: Callable[[int], BufferLayout], make_stager: MakeStager,
                 follower: Follower | None = None, step_outputs: StepOutputs | None = None,
                 extra: dict[str, int | tuple[int, ...]] | None = None):
        super().__init__(model, kv_caches, sizes, meta_layout(sizes[-1]), device, make_stager,
                         follower, step_outputs, extra)
        self.max_model_len = max_model_len
        self.query_start_loc = torch.arange(sizes[-1] + 1, dtype=torch.int32, device=device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def size_for(self, batch: int) -> int:
        """The smallest captured size that holds `batch` rows."""
        return next(s for s in self.sizes if s >= batch)

    def attention_meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.tokens.slot_mapping[:size],
            block_tables=self.meta.block_tables[:size], seq_lens=self.meta.seq_lens[:size],
            query_start_loc=self.query_start_loc[:size + 1], max_query_len=1,
            max_seq_len=self.max_model_len)


class DecodeGraphs(OneTokenGraphs):
    """Two kinds of a step's other inputs can travel in its inputs' extra segments, copied in
    with the rest: with `copy_staged_blocks` (Ops') and `max_copies`, its block copies (forked
    beams'), in `block_copies`, made by a BlockCopyGraph over it replayed before the step's
    graph; with `masked_rows`, its constrained rows' masked-draw inputs, in `masked_draw`
    ([3, masked_rows]: MaskedDrawGraphs' layout), which that draw reads after the step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device, follower: Follower | None = None,
                 step_outputs: StepOutputs | None = None,
                 copy_staged_blocks: Callable | None = None, max_copies: int = 0,
                 masked_rows: int = 0):
        extra = {}
        if copy_staged_blocks is not None:
            extra["block_copies"] = 1 + 2 * max_copies
        if masked_rows:
            extra["masked_draw"] = (3, masked_rows)
        super().__init__(model, kv_caches, sizes, max_model_len, device,
                         lambda rows: decode_meta_layout(rows, max_blocks_per_seq),
                         lambda tokens, meta: DecodeStager(tokens, meta, block_size), follower,
                         step_outputs, extra)
        first, second = (staging.stager for staging in self._staging)
        first.peer, second.peer = second, first  # the mirrors take turns: one holds the last step
        self.steps_continued = 0  # steps staged by DecodeStager.write_continued
        self.block_copy = None if copy_staged_blocks is None else BlockCopyGraph(
            copy_staged_blocks, kv_storage(kv_caches), max_copies, self.tokens.block_copies)
        # the device segment a masked draw reads a step's inputs from (None: none staged here)
        self.masked_draw_inputs = self.tokens.masked_draw if masked_rows else None

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._logits_and_draws(self._hidden(size))

    def capture(self, pool=None):
        pool = super().capture(pool)
        return pool if self.block_copy is None else self.block_copy.capture(pool)

    def takes_copies(self, copies: tuple[tuple[int, int], ...]) -> bool:
        """Whether `run` makes these block copies (before the step's forward)."""
        return self.block_copy is not None and len(copies) <= self.block_copy.max_pairs

    def run(self, seqs: list[ScheduledSequence] | None, sources: list[int],
            prev_tokens: torch.Tensor | None, draw_inputs: DrawInputs,
            continued: Continued | None = None,
            block_copies: tuple[tuple[int, int], ...] = (),
            stage_masked: Callable[[np.ndarray], None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """sources[i] >= 0: sequence i's placeholder's row in prev_tokens. `continued`: when
        the last replay of these graphs was the step just before and every row continues one
        of its rows (DecodeStager.write_continued; `seqs` is then not read and may be None).
        `block_copies`: the step's, if any (takes_copies). `stage_masked`: writes the step's
        masked-draw inputs into the mirror's `masked_draw` segment. Returns logits [B, vocab]
        and drawn tokens [B], valid until the next replay."""
        batch = len(sources)
        size = self.size_for(batch)
        def stage(stager: DecodeStager) -> None:
            if continued is None:
                stager.write(seqs, size, sources, draw_inputs)
            else:
                stager.write_continued(size, continued, draw_inputs)
            if block_copies:
                stage_pairs(stager.tokens.block_copies, block_copies)
            if stage_masked is not None:
                stage_masked(stager.tokens.masked_draw)

        self.steps_continued += continued is not None
        self._replay(size, stage, prev_tokens, size,
                     self.block_copy.replay if block_copies else None)
        logits, drawn = self.outputs[size]
        return logits[:batch], drawn[:batch]


class DecodeStager:
    """Writes decode steps into one pinned mirror's views (`tokens`: token_layout; `meta`:
    decode_meta_layout), padded to `size` rows: token 0 at position 0, slot -1, greedy draw,
    seq_len 1, block table [0]. A table row is rewritten only when its blocks changed;
    entries past a row's blocks may be stale (kernels read only below the length)."""

    def __init__(self, tokens: SimpleNamespace, meta: SimpleNamespace, block_size: int):
        self.tokens, self.meta, self.block_size = tokens, meta, block_size
        n = len(tokens.token_ids)
        self._own_token = np.arange(n, 2 * n)  # token_source of each row's own token id
        self._rows: list[tuple[int, ...] | None] = [None] * n  # what each table row holds
        self.peer: DecodeStager | None = None  # the other mirror's stager (DecodeGraphs)

    def write(self, seqs: list[ScheduledSequence], size: int, sources: list[int],
              draw_inputs: DrawInputs) -> None:
        """`draw_inputs`: Sampler.draw_inputs'."""
        batch, t = len(seqs), self.tokens
        self._write_tables(seqs, size)
        token_ids, positions = t.token_ids[:batch], t.positions[:batch]
        token_ids[:] = [s.token_ids[0] for s in seqs]
        np.maximum(token_ids, 0, out=token_ids)  # a placeholder's id comes from prev_tokens
        positions[:] = [s.start_position for s in seqs]
        source = t.token_source[:batch]
        source[:] = sources
        np.copyto(source, self._own_token[:batch], where=source < 0)
        self._write_rest(batch, size, draw_inputs)

    def write_continued(self, size: int, continued: Continued, draw_inputs: DrawInputs
                        ) -> None:
        """write(), for a step whose every row i is a placeholder continuing row src[i] of
        the step the peer staged just before: its position is that row's plus one, its block
        table that row's, read from the peer's arrays, not from the rows. A table grows only
        as a position starts a block (Scheduler._add_decode_ahead), so only those rows ask
        `continued.new_table` for theirs. Per-row Python work: those rows, and one C-level
        pass over the peer's held tables."""
        src, bs, t, last = continued.src, self.block_size, self.tokens, self.peer
        batch, tables, held = len(src), self.meta.block_tables, self._rows
        tables[:batch] = last.meta.block_tables[src]
        held[:batch] = map(last._rows.__getitem__, src.tolist())
        positions = t.positions[:batch]
        np.add(last.tokens.positions[src], 1, out=positions)
        for row in np.flatnonzero(positions % bs == 0).tolist():  # a new block: the new table
            block_ids = continued.new_table(row, held[row])
            tables[row, :len(block_ids)] = block_ids
            held[row] = tuple(block_ids)
        self._pad_tables(batch, size)
        t.token_ids[:batch] = 0  # every row's token comes from prev_tokens
        t.token_source[:batch] = src
        self._write_rest(batch, size, draw_inputs)

    def _write_rest(self, batch: int, size: int, draw_inputs: DrawInputs) -> None:
        """Slots and sequence lengths of the first `batch` rows (positions and tables
        written), padding rows, draw inputs."""
        bs, t = self.block_size, self.tokens
        positions = t.positions[:batch]
        rows = np.arange(batch)
        t.slot_mapping[:batch] = self.meta.block_tables[rows, positions // bs] * bs + positions % bs
        t.token_ids[batch:size] = 0
        t.positions[batch:size] = 0
        t.slot_mapping[batch:size] = -1
        t.token_source[batch:size] = self._own_token[batch:size]
        stage_draw_inputs(t, draw_inputs, size)
        self.meta.seq_lens[:batch] = positions + 1
        self.meta.seq_lens[batch:size] = 1

    def _write_tables(self, seqs: list[ScheduledSequence], size: int) -> None:
        tables = self.meta.block_tables
        for row, s in enumerate(seqs):
            if self._rows[row] != s.block_ids:
                tables[row, :len(s.block_ids)] = s.block_ids
                self._rows[row] = tuple(s.block_ids)  # no copy of the scheduler's tuple
        self._pad_tables(len(seqs), size)

    def _pad_tables(self, batch: int, size: int) -> None:
        tables = self.meta.block_tables
        for row in range(batch, size):
            if self._rows[row] != PADDING_ROW:
                tables[row, 0] = 0
                self._rows[row] = PADDING_ROW
