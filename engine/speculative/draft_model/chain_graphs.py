"""The draft model's greedy decode iterations, chained on the device: `greedy_chain` (eager)
and `DraftChainGraphs` (a graph per iteration and padded batch size, each reading the one
before it on the device). docs/speculative.md section 8 places them in a step.

    iteration   0          1          2          3          (k = 4; a row with 4 drafts,
    feeds       t19 @19    d1 @20     d2 @21     d3 @22      last known token t19 at 19)
    draws       d1         d2         d3         d4         iteration i + 1 feeds i's draw
    writes      KV @19     KV @20     KV @21     KV @22     the draft's, in the row's slots

A row with d < k drafts repeats its last position later without writing (slot -1); its drafts
after the d-th are NO_TOKEN. `ChainPlan` computes every iteration's inputs on the device
before the first. A graph per iteration, not per chain: the device starts on the first while
the host launches the next.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from engine.core.batch import ScheduledSequence
from engine.speculative.draft_model.chain_start import chain_plan, chain_start, slots_at
from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.buffers import BufferLayout
from engine.worker.cuda_graphs.decode import DecodeStager, OneTokenGraphs
from engine.worker.cuda_graphs.graph_set import capture_graph
from engine.worker.sampler import NO_TOKEN

Draw = Callable[[torch.Tensor], torch.Tensor]  # hidden states [B, D] -> greedy tokens [B]


@dataclass(frozen=True)
class ChainPlan:
    """Each iteration's inputs, [iterations, rows] each: row i is iteration i's."""
    positions: torch.Tensor  # int64
    slots: torch.Tensor  # int64, -1 where the row writes no KV
    seq_lens: torch.Tensor  # int32
    drafted: torch.Tensor  # bool: the row drafts at this iteration

    @staticmethod
    def of(positions: torch.Tensor, block_tables: torch.Tensor, draft_counts: torch.Tensor,
           iterations: int, block_size: int) -> ChainPlan:
        return ChainPlan(*chain_plan(positions, block_tables, draft_counts, iterations, block_size))

    def iteration(self, model: torch.nn.Module, kv_caches: list, input_ids: torch.Tensor,
                  meta: AttentionMetadata, i: int, draw: Draw) -> torch.Tensor:
        """Iteration i's greedy tokens, one a row, from its input ids; `meta`: the rows'
        block tables, query starts and longest length before the first iteration."""
        step_meta = replace(meta, slot_mapping=self.slots[i], seq_lens=self.seq_lens[i],
                            max_seq_len=meta.max_seq_len + i, seq_lens_host=None)
        return draw(model(input_ids, self.positions[i], kv_caches, step_meta))

    def settle_(self) -> None:
        """Every iteration at position 0, writing nothing (slot -1), drafting nothing."""
        self.positions.zero_()
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        self.drafted.zero_()

    def drafts(self, tokens: torch.Tensor, i: int) -> torch.Tensor:
        """Iteration i's tokens as drafts: NO_TOKEN for rows drafting fewer."""
        return tokens.masked_fill(~self.drafted[i], NO_TOKEN)


def feed_for_kv(model: torch.nn.Module, kv_caches: list, input_ids: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata, block_size: int) -> None:
    """The model's forward over one token a row at `positions` (-1: the row writes nothing),
    for its KV only; `meta`: the rows' block tables, query starts and longest length."""
    at = positions.clamp(min=0)
    slots = slots_at(meta.block_tables, at[:, None], block_size).squeeze(1)
    meta = replace(meta, slot_mapping=torch.where(positions >= 0, slots, -1),
                   seq_lens=(at + 1).int(), seq_lens_host=None)
    model(input_ids, at, kv_caches, meta)


def greedy_chain(model: torch.nn.Module, kv_caches: list, input_ids: torch.Tensor,
                 positions: torch.Tensor, meta: AttentionMetadata, draft_counts: torch.Tensor,
                 iterations: int, draw: Draw) -> torch.Tensor:
    """`iterations` greedy decode steps from one token a row (`input_ids` at `positions`),
    row r drafting draft_counts[r] tokens. Returns int64 [rows, iterations], NO_TOKEN past a
    row's count."""
    plan = ChainPlan.of(positions, meta.block_tables, draft_counts, iterations,
                        kv_caches[0][0].shape[1])
    columns = []
    for i in range(iterations):
        input_ids = plan.iteration(model, kv_caches, input_ids, meta, i, draw)
        columns.append(plan.drafts(input_ids, i))
    return torch.stack(columns, dim=1)


def chain_meta_layout(max_batch: int, max_blocks_per_seq: int) -> BufferLayout:
    """The decode layout plus each row's draft count and catch-up: its last draft's position
    in the last run (-1: none) and that draft's index in the flattened `drafts`."""
    return BufferLayout(seq_lens=max_batch, draft_counts=max_batch,
                        catch_up_positions=max_batch, catch_up_sources=max_batch,
                        block_tables=(max_batch, max_blocks_per_seq))


CatchUp = tuple[int, int, int]  # last draft's position in the last run; its row and column


class DraftChainGraphs(OneTokenGraphs):
    """greedy_chain's iterations (up to `iterations`), a graph each per padded batch size:
    graphs[size][0] records first_iteration(size), graphs[size][i] iteration(size, i, ...)
    over the plan and tokens that the graphs before it left. The drafts land in `drafts`.
    When some row catches up, catching_up_graphs[size] (first_iteration_catching_up) takes
    the first iteration's place."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device, iterations: int,
                 start_op: Callable[..., None] = chain_start):
        """start_op: the ahead run's start (`chain_start` or its kernel, `chain_start_op`)."""
        super().__init__(model, kv_caches, sizes, max_model_len, device,
                         lambda rows: chain_meta_layout(rows, max_blocks_per_seq),
                         lambda tokens, meta: DraftChainStager(tokens, meta, block_size))
        self.iterations, self.block_size, self.start_op = iterations, block_size, start_op
        self.drafts = torch.full((self.max_batch, iterations), NO_TOKEN, dtype=torch.int64,
                                 device=device)
        self.meta.catch_up_positions.fill_(-1)  # no row catches up during capture
        self.catching_up_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.ahead_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # what an ahead run reads of its verification: accepted counts, sampled tokens
        self.verified = torch.zeros((2, self.max_batch), dtype=torch.int64, device=device)
        self.pair_starts = torch.arange(0, 2 * self.max_batch + 1, 2, dtype=torch.int32,
                                        device=device)

    def first_iteration_catching_up(self, size: int,
                                    first: tuple[ChainPlan, torch.Tensor] | None = None
                                    ) -> tuple[ChainPlan, torch.Tensor]:
        """first_iteration, also feeding each catching-up row's last draft of the last run
        one position before the row's (two tokens for such a row, one for others, packed
        varlen). Copies its plan and tokens into `first`, which later iterations read."""
        m, n = self.meta, 2 * size  # n: the token rows' capacity, index n a trash entry
        own_tokens, positions, plan = self._planned_inputs(size)
        catching_up = m.catch_up_positions[:size] >= 0
        own_rows = torch.arange(size, device=positions.device) + catching_up.cumsum(0)
        catch_up_rows = torch.where(catching_up, own_rows - 1, n)
        # a row without a catch-up reads any entry, NO_TOKEN too: clamped to a token id
        catch_up_tokens = self.drafts.view(-1).index_select(0, m.catch_up_sources[:size])
        catch_up_at = (positions - 1).clamp(min=0)
        catch_up_slots = slots_at(m.block_tables[:size], catch_up_at[:, None],
                                  self.block_size).squeeze(1)

        def packed(own: torch.Tensor, catch_up: torch.Tensor, fill: int) -> torch.Tensor:
            rows = own.new_full((n + 1,), fill)
            return rows.index_copy(0, own_rows, own).index_copy(0, catch_up_rows, catch_up)[:n]

        meta = AttentionMetadata(
            slot_mapping=packed(plan.slots[0], catch_up_slots, -1),
            block_tables=m.block_tables[:size], seq_lens=plan.seq_lens[0],
            query_start_loc=torch.cat([own_rows.new_zeros(1), own_rows + 1]).int(),
            max_query_len=2, max_seq_len=self.max_model_len)
        hidden = self.model(packed(own_tokens, catch_up_tokens.clamp(min=0), 0),
                            packed(positions, catch_up_at, 0), self.kv_caches, meta)
        tokens = self._logits_and_draws(hidden.index_select(0, own_rows))[1]
        self.drafts[:size, 0] = plan.drafts(tokens, 0)
        if first is not None:
            for field in ("positions", "slots", "seq_lens", "drafted"):
                getattr(first[0], field).copy_(getattr(plan, field))
            first[1].copy_(tokens)
        return plan, tokens

    def first_iteration_ahead(self, size: int, first: tuple[ChainPlan, torch.Tensor]) -> None:
        """The first iteration of a run queued ahead, from the staged last run and `verified`
        (two token rows a sequence: chain_start.py); writes its plan and tokens into `first`."""
        plan, tokens = first
        m, device = self.meta, self.drafts.device
        inputs = [torch.empty(2 * size, dtype=torch.int64, device=device) for _ in range(3)]
        self.start_op(
            self.tokens.positions[:size], self.tokens.token_ids[:size], m.draft_counts[:size],
            m.block_tables[:size], self.drafts[:size], self.verified[0, :size],
            self.verified[1, :size], self.block_size, plan.positions, plan.slots,
            plan.seq_lens, plan.drafted, *inputs)
        token_ids, positions, slots = inputs
        meta = AttentionMetadata(
            slot_mapping=slots, block_tables=m.block_tables[:size], seq_lens=plan.seq_lens[0],
            query_start_loc=self.pair_starts[:size + 1], max_query_len=2,
            max_seq_len=self.max_model_len)
        hidden = self.model(token_ids, positions, self.kv_caches, meta)
        tokens.copy_(self._logits_and_draws(hidden[1::2])[1])
        self.drafts[:size, 0] = plan.drafts(tokens, 0)

    def _planned_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ChainPlan]:
        """The first `size` rows' staged input ids, positions, and every iteration's plan."""
        input_ids, positions = self._inputs(size)
        plan = ChainPlan.of(positions, self.meta.block_tables[:size],
                            self.meta.draft_counts[:size], self.iterations, self.block_size)
        return input_ids, positions, plan

    def first_iteration(self, size: int) -> tuple[ChainPlan, torch.Tensor]:
        """Plan the first `size` rows' iterations and run the first: (plan, tokens)."""
        input_ids, _, plan = self._planned_inputs(size)
        return plan, self.iteration(size, 0, plan, input_ids)

    def iteration(self, size: int, i: int, plan: ChainPlan,
                  input_ids: torch.Tensor) -> torch.Tensor:
        """Iteration i over the first `size` rows: its tokens, and its drafts written."""
        tokens = plan.iteration(self.model, self.kv_caches, input_ids, self.attention_meta(size),
                                i, lambda hidden: self._logits_and_draws(hidden)[1])
        self.drafts[:size, i] = plan.drafts(tokens, i)
        return tokens

    @torch.inference_mode()
    def capture(self, pool=None):
        """Each graph reads the captured outputs of the graphs before it. Those hold stale
        pool memory until replayed, so they are settled (empty plan, token 0) before the next
        warm-up reads them; the first-iteration variants, which write them, go last."""
        for size in reversed(self.sizes):
            first, pool, first_outputs = capture_graph(lambda: self.first_iteration(size), pool)
            self.graphs[size] = [first]
            plan, tokens = first_outputs
            plan.settle_()
            for i in range(1, self.iterations):
                tokens.zero_()
                graph, pool, tokens = capture_graph(
                    lambda: self.iteration(size, i, plan, tokens), pool)
                self.graphs[size].append(graph)
            self.catching_up_graphs[size], pool, _ = capture_graph(
                lambda: self.first_iteration_catching_up(size, first_outputs), pool)
            self.ahead_graphs[size], pool, _ = capture_graph(
                lambda: self.first_iteration_ahead(size, first_outputs), pool)
        torch.cuda.synchronize()
        return pool

    def run(self, rows: list[ScheduledSequence], draft_counts: list[int],
            catch_ups: list[CatchUp | None]) -> torch.Tensor:
        """Replay the first max(draft_counts) iterations for these rows (each its last known
        token at its position), the first one catching up if any row has a catch-up;
        returns their drafts [len(rows), max(draft_counts)], valid until the next run."""
        size, width = self.size_for(len(rows)), max(draft_counts)
        self._stage(rows, draft_counts, catch_ups, size)
        graphs = self.graphs[size][:width]
        if any(c is not None for c in catch_ups):
            graphs = [self.catching_up_graphs[size], *graphs[1:]]
        for graph in graphs:
            graph.replay()
        return self.drafts[:len(rows), :width]

    def run_ahead(self, rows: list[ScheduledSequence], draft_counts: list[int],
                  num_accepted: torch.Tensor, sampled: torch.Tensor) -> None:
        """Queue the next run of `rows` (as run() got them) behind their verification, its
        inputs advanced on the device from `num_accepted` and `sampled` per row. Draft counts
        and block tables stay: the caller checks the next step is the one drafted for, and
        the tables must cover each row's position + 2 x its draft count.

            rows       feed t @q, d1 @q+1, ..., dk-1 @q+k-1      drew d1..dk
            verified   A drafts accepted, then s                   next known token s @q+A+1
            this run   feeds [d_A @q+A, s @q+A+1] (d_0 = t), ...   writes KV up to q+A+k
        """
        size, width = self.size_for(len(rows)), max(draft_counts)
        self._stage(rows, draft_counts, [None] * len(rows), size)
        self.verified[0, :len(rows)] = num_accepted
        self.verified[1, :len(rows)] = sampled
        for graph in [self.ahead_graphs[size], *self.graphs[size][1:width]]:
            graph.replay()

    def _stage(self, rows: list[ScheduledSequence], draft_counts: list[int],
               catch_ups: list[CatchUp | None], size: int) -> None:
        sources = [None if c is None else (c[0], c[1] * self.iterations + c[2])
                   for c in catch_ups]
        self._copy_in(lambda stager: stager.write_chain(rows, draft_counts, sources, size),
                      None, size)


class DraftChainStager(DecodeStager):
    """A decode step of the rows, drawn greedily, each row's draft count (0: padding) and
    catch-up (position -1: none)."""

    def write_chain(self, rows: list[ScheduledSequence], draft_counts: list[int],
                    catch_ups: list[tuple[int, int] | None], size: int) -> None:
        """catch_ups: per row, None or (position, index in the flattened drafts)."""
        batch, m = len(rows), self.meta
        self.write(rows, size, [-1] * batch, (np.zeros(batch), np.zeros(batch, np.int64)))
        m.draft_counts[:batch] = draft_counts
        m.draft_counts[batch:size] = 0
        m.catch_up_positions[:size] = -1
        m.catch_up_sources[:size] = 0
        for row, catch_up in enumerate(catch_ups):
            if catch_up is not None:
                m.catch_up_positions[row], m.catch_up_sources[row] = catch_up
