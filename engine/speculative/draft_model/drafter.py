"""The draft_model method's worker side: a second ModelRunner whose KV pool has the target's
block count and size, so the target's block tables index it too (docs/speculative.md, 8).

    follow()       the draft's forward over a target step's inputs, for KV only
    fill()         greedy drafts for a step's sampling sequences, on the device, no host sync
    draft_ahead()  the next step's drafts, queued right behind a verification

Invariant: the draft has KV wherever the target has. A step whose every sequence verifies
drafts may skip the follow (`skips_follow`): fill wrote the draft's KV for each last token
and every draft but the last, and the draft_ahead queued behind that step writes the last
one's where it was accepted. Drafts are the argmax (one-hot q), so `accept_drawn` stays exact.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.core.batch import ScheduledSequence
from engine.core.request import SamplingParams
from engine.speculative.draft_model.chain_graphs import DraftChain
from engine.speculative.draft_model.chain_start import chain_start_op
from engine.worker.attention import AttentionMetadata
from engine.worker.sampler import NO_TOKEN, SamplerOutput

log = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0.0)


class Drafter:
    def __init__(self, runner, max_drafts: int) -> None:
        """runner: the draft's ModelRunner (KV cache allocated, no step graphs of its own);
        its chain of up to max_drafts iterations is captured where it may use graphs."""
        self.runner = runner
        self.chain = DraftChain(runner.model, runner.kv_caches, runner.graph_plan.decode_sizes,
                                runner.max_blocks_per_seq, runner.block_size, runner.device,
                                max_drafts, chain_start_op(runner.attention_backend))
        if runner.uses_graphs:
            start = time.perf_counter()
            self.chain.capture()
            log.info("captured the draft's %d iterations for batch sizes %s in %.1f s",
                     max_drafts, self.chain.sizes, time.perf_counter() - start)
        self.num_taken_ahead = 0  # fills that took the drafts made ahead

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """The draft's forward over a target step's inputs, for its KV only."""
        self.runner.model(input_ids, positions, self.runner.kv_caches, meta)

    def skips_follow(self, seqs: list[ScheduledSequence]) -> bool:
        """Whether a step of `seqs` runs without the follow pass, then draft_ahead: every
        sequence verifies drafts and its table covers its position + 2 x its drafts (that
        run writes KV up to there)."""
        block_size = self.runner.block_size
        return all(s.num_drafts and len(s.block_ids) * block_size > s.start_position
                   + 2 * s.num_drafts for s in seqs)

    def fill(self, seqs: list[ScheduledSequence], drafted_ahead: bool) -> torch.Tensor:
        """Greedy drafts for `seqs` (a step's sampling sequences): int64 [len(seqs), most
        drafts] on the device, NO_TOKEN past a sequence's own; no host sync. drafted_ahead:
        the last draft_ahead was for this step (its sequences, in order, with these draft
        counts, right after the verification it followed): its drafts are taken."""
        if drafted_ahead:
            self.num_taken_ahead += 1
            return self.chain.drafts[:len(seqs), :max(s.num_drafts for s in seqs)]
        return self.chain.run([_chain_row(s) for s in seqs], [s.num_drafts for s in seqs])

    def draft_ahead(self, seqs: list[ScheduledSequence], verified: SamplerOutput) -> None:
        """After a step of `seqs` without the follow pass (skips_follow): queue the next
        step's drafts from `verified` on the device."""
        # a row: its accepted drafts, its sampled token, then NO_TOKEN
        num_accepted = (verified.verified_token_ids != NO_TOKEN).sum(1) - 1
        self.chain.run_ahead([_chain_row(s) for s in seqs], [s.num_drafts for s in seqs],
                             num_accepted, verified.token_ids)


def _chain_row(seq: ScheduledSequence) -> ScheduledSequence:
    """seq's row in the chain: its last known token at its position (a row without drafts
    is padding: it writes and returns nothing)."""
    known = len(seq.token_ids) - seq.num_drafts
    return ScheduledSequence(seq.request_id, [seq.token_ids[known - 1]],
                             seq.start_position + known - 1, seq.block_ids, True, GREEDY)
