"""The draft_model method's worker side: a second ModelRunner whose KV pool has the target's
block count and size, so the target's block tables index it too (docs/speculative.md, 8).

    follow()       the draft's forward over a target step's inputs, for KV only (skipped
                   when every sequence verifies drafts: fill wrote all but the last draft's)
    fill()         greedy drafts for a step's sampling sequences, on the device, no host sync
    draft_ahead()  the next step's drafts queued right behind a verification (chain graphs)

Invariant: the draft has KV wherever the target has, bar a `catch_ups()` hole fed before the
next drafting. Drafts are the argmax (one-hot q), so `accept_drawn` stays exact.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from engine.core.batch import ScheduledSequence
from engine.core.request import SamplingParams
from engine.speculative.draft_model.chain_graphs import (CatchUp, DraftChainGraphs,
                                                         feed_for_kv, greedy_chain)
from engine.speculative.draft_model.chain_start import chain_start_op
from engine.worker.attention import AttentionMetadata
from engine.worker.inputs import StepInputs, prepare_host_inputs, to_device, upload
from engine.worker.sampler import NO_TOKEN, SamplerOutput

log = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0.0)


class Drafter:
    def __init__(self, runner, max_drafts: int) -> None:
        """runner: the draft's ModelRunner (KV cache allocated, no step graphs of its own);
        where it may use graphs, its chain of up to max_drafts iterations is captured."""
        self.runner = runner
        self.chain = self._capture_chain(max_drafts) if runner.uses_graphs else None
        self._unfollowed: dict[str, CatchUp] = {}  # after a step without follow (catch_ups)
        self._last_drafts: torch.Tensor | None = None
        self._drafted_ahead: list[tuple[str, int]] | None = None  # (request id, drafts) rows
        self.num_taken_ahead = 0  # fills that took the drafts made ahead

    def _capture_chain(self, max_drafts: int) -> DraftChainGraphs:
        runner, sched, start = self.runner, self.runner.config.scheduler, time.perf_counter()
        chain = DraftChainGraphs(runner.model, runner.kv_caches, runner.graph_plan.decode_sizes,
                                 runner.max_blocks_per_seq, runner.block_size,
                                 sched.max_model_len, runner.device, max_drafts,
                                 chain_start_op(runner.attention_backend))
        chain.capture()
        log.info("captured the draft's %d iterations for batch sizes %s in %.1f s", max_drafts,
                 chain.sizes, time.perf_counter() - start)
        return chain

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The draft's forward over a target step's inputs, for its KV only."""
        self.runner.model(input_ids, positions, self.runner.kv_caches, meta)

    def fill(self, seqs: list[ScheduledSequence], skips_follow: bool) -> torch.Tensor:
        """Greedy drafts for `seqs` (a step's sampling sequences): int64 [len(seqs), most
        drafts] on the device, NO_TOKEN past a sequence's own; no host sync. `skips_follow`:
        the target's step runs without the follow pass."""
        width = max(s.num_drafts for s in seqs)
        drafted_ahead, self._drafted_ahead = self._drafted_ahead, None
        if skips_follow and drafted_ahead == [(s.request_id, s.num_drafts) for s in seqs]:
            drafts = self.chain.drafts[:len(seqs), :width]
            self.num_taken_ahead += 1
        else:
            rows, counts = [_chain_row(s) for s in seqs], [s.num_drafts for s in seqs]
            catch_ups = self.catch_ups(seqs)
            if self.chain is not None:
                drafts = self.chain.run(rows, counts, catch_ups)
            else:
                self._eager_catch_up(rows, catch_ups)
                drafts = self._last_drafts = self._eager_chain(rows, counts, width)
        self._unfollowed = {s.request_id: (s.start_position + s.num_drafts, row,
                                           s.num_drafts - 1)
                            for row, s in enumerate(seqs) if s.num_drafts and skips_follow}
        return drafts

    def draft_ahead(self, seqs: list[ScheduledSequence], verified: SamplerOutput) -> None:
        """After a step that verified drafts of every sequence in `seqs` without following:
        queue the next step's drafts from `verified` on the device. A no-op without chain
        graphs or unless every table covers the row's lookahead."""
        block_size = self.runner.block_size
        if self.chain is None or not all(
                s.num_drafts and len(s.block_ids) * block_size > s.start_position + 2 * s.num_drafts
                for s in seqs):
            return
        # a row: its accepted drafts, its sampled token, then NO_TOKEN
        num_accepted = (verified.verified_token_ids != NO_TOKEN).sum(1) - 1
        self.chain.run_ahead([_chain_row(s) for s in seqs], [s.num_drafts for s in seqs],
                             num_accepted, verified.token_ids)
        self._drafted_ahead = [(s.request_id, s.num_drafts) for s in seqs]
        self._unfollowed = {}  # run_ahead caught up every row that accepted all its drafts

    def catch_ups(self, seqs: list[ScheduledSequence]) -> list[CatchUp | None]:
        """Per row of `seqs` (the next fill's), the last draft to feed before drafting again,
        or None. A step without the follow pass leaves no draft KV at a row's last draft; a
        row that accepted every draft decodes right after it, so that draft is fed first (read
        from the last fill's). It changes nothing: fill(seqs) feeds exactly these, unless it
        takes the drafts made ahead (draft_ahead caught every row up then)."""
        def catch_up(seq: ScheduledSequence) -> CatchUp | None:
            last = self._unfollowed.get(seq.request_id)
            follows_last = (last is not None and last[0] == seq.start_position - 1
                            and len(seq.token_ids) == seq.num_drafts + 1)
            return last if seq.num_drafts and follows_last else None

        return [catch_up(s) for s in seqs]

    def _eager_catch_up(self, rows: list[ScheduledSequence],
                        catch_ups: list[CatchUp | None]) -> None:
        """Without graphs: feed the catching-up rows' last drafts, for KV only."""
        lagging = [(row, c) for row, c in zip(rows, catch_ups) if c is not None]
        if not lagging:
            return
        runner = self.runner
        step = self._inputs([replace(row, start_position=position)
                             for row, (position, _, _) in lagging])
        last_rows, columns = (upload([c[i] for _, c in lagging], torch.int64, runner.device)
                              for i in (1, 2))
        feed_for_kv(runner.model, runner.kv_caches, self._last_drafts[last_rows, columns],
                    step.positions, step.meta, runner.block_size)

    def _eager_chain(self, rows: list[ScheduledSequence], counts: list[int],
                     width: int) -> torch.Tensor:
        """greedy_chain without graphs (CPU, eager mode, the torch attention backend)."""
        runner, model = self.runner, self.runner.model
        step = self._inputs(rows)
        greedy = torch.zeros(len(rows), device=runner.device)

        def draw(hidden: torch.Tensor) -> torch.Tensor:
            return model.ops.sample(model.lm_head(hidden), greedy, greedy.long())

        return greedy_chain(model, runner.kv_caches, step.input_ids, step.positions, step.meta,
                            upload(counts, torch.int32, runner.device), width, draw)

    def _inputs(self, rows: list[ScheduledSequence]) -> StepInputs:
        runner = self.runner
        return to_device(prepare_host_inputs(rows, runner.block_size, runner.max_blocks_per_seq),
                         runner.device)


def _chain_row(seq: ScheduledSequence) -> ScheduledSequence:
    """seq's first drafting iteration: its last known token at its position (token 0 for a
    sequence without drafts, whose row writes and returns nothing)."""
    known = len(seq.token_ids) - seq.num_drafts
    token = seq.token_ids[known - 1] if seq.num_drafts else 0
    return ScheduledSequence(seq.request_id, [token], seq.start_position + known - 1,
                             seq.block_ids, True, GREEDY)
