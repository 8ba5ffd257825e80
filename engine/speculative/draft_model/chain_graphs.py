"""The draft model's greedy decode iterations, chained on the device. docs/speculative.md
section 8 places them in a step.

    iteration   0                1          2          3          (k = 4; a row with 4 drafts,
    feeds       s @p             d1 @p+1    d2 @p+2    d3 @p+3     next token s at p)
    draws       d1               d2         d3         d4         iteration i + 1 feeds i's draw
    writes      KV @p            KV @p+1    KV @p+2    KV @p+3    the draft's, in the row's slots

Every run starts the same way (chain_start.py): from the rows' staged next tokens and
positions, moved on by the drafts their verification accepted (a run queued ahead,
`run_ahead`, reads those on the device); where a row accepted all its last drafts, iteration
0 feeds the last one at p - 1 before s, so it feeds one or two tokens a row, packed. A row
with d < k drafts repeats its last position later without writing (slot -1); its drafts
after the d-th are NO_TOKEN.

`DraftChain` stages a run once and calls its iterations over the staged buffers, padded to
a batch size of `sizes`: captured, each is a CUDA graph per size, launched back to back (the
device starts on the first while the host launches the next: one graph of all k costs the
host more to launch than k small ones); uncaptured (CPU, eager mode), the same calls run
eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.core.batch import ScheduledSequence
from engine.speculative.draft_model.chain_start import chain_start
from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.buffers import BufferLayout
from engine.worker.cuda_graphs.decode import DecodeStager
from engine.worker.cuda_graphs.graph_set import GraphSet, capture_graph
from engine.worker.sampler import NO_TOKEN


@dataclass(frozen=True)
class ChainPlan:
    """Each iteration's inputs, [iterations, rows] each: row i is iteration i's."""
    positions: torch.Tensor  # int64
    slots: torch.Tensor  # int64, -1 where the row writes no KV
    seq_lens: torch.Tensor  # int32
    drafted: torch.Tensor  # bool: the row draws a draft at this iteration

    @staticmethod
    def empty(iterations: int, rows: int, device: torch.device) -> ChainPlan:
        """A plan of padding rows: position 0, writing and drafting nothing."""
        shape = (iterations, rows)
        return ChainPlan(torch.zeros(shape, dtype=torch.int64, device=device),
                         torch.full(shape, -1, dtype=torch.int64, device=device),
                         torch.ones(shape, dtype=torch.int32, device=device),
                         torch.zeros(shape, dtype=torch.bool, device=device))


class DraftChain(GraphSet):
    """Runs of up to `iterations` greedy iterations over staged rows; the drafts land in
    `drafts`. Iteration i of size s reads the plan in plans[s] and the tokens iteration i - 1
    returned; capture() records it as graphs[s][i]."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, block_size: int, device: torch.device,
                 iterations: int, start_op: Callable[..., None] = chain_start):
        """start_op: `chain_start` or its kernel (`chain_start_op` picks)."""
        rows = sizes[-1]  # per row: its draft count (0: padding), accepted drafts, table
        meta_layout = BufferLayout(draft_counts=rows, num_accepted=rows,
                                   block_tables=(rows, max_blocks_per_seq))
        super().__init__(model, kv_caches, sizes, meta_layout, device,
                         lambda tokens, meta: DraftChainStager(tokens, meta, block_size))
        self.iterations, self.block_size, self.start_op = iterations, block_size, start_op
        # the decode kernel's split grid is sized on the host, so by the longest context
        # any block table holds
        self.max_seq_len = max_blocks_per_seq * block_size
        self.drafts = torch.full((rows, iterations), NO_TOKEN, dtype=torch.int64, device=device)
        self.plans = {size: ChainPlan.empty(iterations, size, device) for size in sizes}
        self.query_starts = torch.arange(rows + 1, dtype=torch.int32, device=device)

    def size_for(self, batch: int) -> int:
        """The smallest size that holds `batch` rows."""
        return next(s for s in self.sizes if s >= batch)

    def iteration(self, size: int, i: int, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Iteration i over the first `size` staged rows: its greedy tokens, one a row, and
        its drafts written. input_ids: iteration i - 1's tokens; iteration 0 starts the run
        instead, its inputs and the plan from the staged rows and the last run's drafts."""
        plan = self.plans[size]
        if i == 0:
            input_ids, positions, slots, query_starts, own_rows = self._start(size)
        else:
            positions, slots, own_rows = plan.positions[i], plan.slots[i], None
            query_starts = self.query_starts[:size + 1]
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=self.meta.block_tables[:size],
            seq_lens=plan.seq_lens[i], query_start_loc=query_starts,
            max_query_len=2 if i == 0 else 1, max_seq_len=self.max_seq_len)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if own_rows is not None:
            hidden = hidden.index_select(0, own_rows)
        tokens = self._logits_and_draws(hidden)[1]
        self.drafts[:size, i] = tokens.masked_fill(~plan.drafted[i], NO_TOKEN)
        return tokens

    def _start(self, size: int) -> tuple[torch.Tensor, ...]:
        """`start_op` over the first `size` staged rows: writes their plan; returns iteration
        0's packed token ids, positions and slots, query starts and each row's token row."""
        m, plan, device = self.meta, self.plans[size], self.drafts.device
        first = [torch.empty(2 * size, dtype=torch.int64, device=device) for _ in range(3)]
        query_starts = torch.empty(size + 1, dtype=torch.int32, device=device)
        own_rows = torch.empty(size, dtype=torch.int64, device=device)
        self.start_op(self.tokens.positions[:size], self.tokens.token_ids[:size],
                      m.draft_counts[:size], m.block_tables[:size], self.drafts[:size],
                      m.num_accepted[:size], self.block_size, plan.positions, plan.slots,
                      plan.seq_lens, plan.drafted, *first, query_starts, own_rows)
        return (*first, query_starts, own_rows)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Every size's iterations, largest size first. The warm-up of iteration i + 1 reads
        the tokens graph i returned, which hold stale pool memory until replayed: they are
        zeroed first. Iteration 0 warms up over the zeroed staged buffers: all padding."""
        for size in reversed(self.sizes):
            self.graphs[size], tokens = [], None
            for i in range(self.iterations):
                graph, pool, tokens = capture_graph(lambda: self.iteration(size, i, tokens),
                                                    pool)
                tokens.zero_()
                self.graphs[size].append(graph)
        torch.cuda.synchronize()
        return pool

    def run(self, rows: list[ScheduledSequence], draft_counts: list[int]) -> torch.Tensor:
        """Draft for `rows` (each its last known token at its position): their drafts
        [len(rows), max(draft_counts)], valid until the next run."""
        size = self._stage(rows, draft_counts, 0)
        self._iterate(size, max(draft_counts))
        return self.drafts[:len(rows), :max(draft_counts)]

    def run_ahead(self, rows: list[ScheduledSequence], draft_counts: list[int],
                  num_accepted: torch.Tensor, sampled: torch.Tensor) -> None:
        """Queue the next run of `rows` (as the last run got them) behind their
        verification, whose `num_accepted` drafts and `sampled` token per row it reads on the
        device. Draft counts and block tables stay: the caller checks the next step is the
        one drafted for, and the tables must cover each row's position + 2 x its count.

            last run   feeds t @q, d1 @q+1, ..., dk-1 @q+k-1      drew d1..dk
            verified   A drafts accepted, then s                   next token s @q+A+1
            this run   feeds s @q+A+1 (after dk @q+k if A = k)     writes KV up to q+A+k
        """
        batch = len(rows)
        size = self._stage(rows, draft_counts, 1)
        self.meta.num_accepted[:batch] = num_accepted
        self.tokens.token_ids[:batch] = sampled
        self._iterate(size, max(draft_counts))

    def _stage(self, rows: list[ScheduledSequence], draft_counts: list[int],
               shift: int) -> int:
        """Stage `rows` at their positions + `shift`, nothing accepted; returns the size."""
        size = self.size_for(len(rows))
        self._copy_in(lambda stager: stager.write_chain(rows, draft_counts, shift, size),
                      None, size)
        return size

    def _iterate(self, size: int, width: int) -> None:
        """The first `width` iterations: the captured graphs, or the same calls eagerly."""
        if size in self.graphs:
            for graph in self.graphs[size][:width]:
                graph.replay()
            return
        tokens = None
        for i in range(width):
            tokens = self.iteration(size, i, tokens)


class DraftChainStager(DecodeStager):
    """Stages a run's rows, padded to `size`: each row's token and position, its draft count
    (0: padding) and no accepted drafts."""

    def write_chain(self, rows: list[ScheduledSequence], draft_counts: list[int], shift: int,
                    size: int) -> None:
        batch, t, m = len(rows), self.tokens, self.meta
        self._write_tables(rows, size)
        t.token_ids[:batch] = [s.token_ids[0] for s in rows]
        t.positions[:batch] = [s.start_position + shift for s in rows]
        t.token_ids[batch:size] = 0
        t.positions[batch:size] = 0
        m.draft_counts[:batch] = draft_counts
        m.draft_counts[batch:size] = 0
        m.num_accepted[:size] = 0
