"""Mixed-step graphs: steps with prompt tokens (prefill chunks, with or without decodes), per
padded token count N, holding R = min(N, max_num_seqs) sequence rows and
min(N, max_sample_rows) sampling rows, and the stager that writes such a step into their
pinned buffers:

    tokens     t0 .. t(T-1)             | T .. N-1: token 0, position 0, slot -1
    sequences  s0 .. s(S-1)             | S .. R-1: no new tokens, seq_len 0
    samples    the sampling sequences' last token rows (with drafts: their last
               num_drafts + 1 rows, engine/speculative/verify.py) | padding: row 0, greedy

The prefill attention grid depends only on shapes, so one capture serves every step that
fits; padding rows write no KV and stay in their own rows. Each graph also outputs its final
hidden states [N, n_embd], which prompt logprobs read after the replay.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.buffers import BufferLayout, stage_draw_inputs
from engine.worker.cuda_graphs.graph_set import Follower, GraphSet, StepOutputs
from engine.worker.inputs import HostInputs
from engine.worker.sampler import DrawInputs

WriteDrafts = Callable[[torch.Tensor], None]  # writes drafts into a step's token ids


def mixed_meta_layout(max_seqs: int, max_blocks_per_seq: int,
                      max_sample_rows: int | None = None) -> BufferLayout:
    """The mixed-step graphs' int32 buffer (sampling rows: max_seqs unless given)."""
    return BufferLayout(query_start_loc=max_seqs + 1, seq_lens=max_seqs,
                        sample_rows=max_sample_rows or max_seqs,
                        block_tables=(max_seqs, max_blocks_per_seq))


class MixedGraphs(GraphSet):
    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: tuple[int, ...],
                 max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device, max_sample_rows: int | None = None,
                 follower: Follower | None = None, step_outputs: StepOutputs | None = None):
        """sizes: token counts, ascending; max_sample_rows: logits rows a step may sample
        (max_num_seqs, or max_num_seqs (k + 1) with drafts)."""
        max_sample_rows = max_sample_rows or max_num_seqs
        super().__init__(model, kv_caches, sizes,
                         mixed_meta_layout(max_num_seqs, max_blocks_per_seq, max_sample_rows),
                         device, MixedStager, follower, step_outputs)
        self.max_seqs = max_num_seqs
        self.max_sample_rows = max_sample_rows
        self.max_model_len = max_model_len

    def rows(self, size: int) -> int:
        """Sequence rows of the graph for `size` tokens (a sequence has at least one)."""
        return min(size, self.max_seqs)

    def sample_rows(self, size: int) -> int:
        """Logits rows of the graph for `size` tokens (each is a token's)."""
        return min(size, self.max_sample_rows)

    def fits(self, host: HostInputs) -> bool:
        return (len(host.token_ids) <= self.sizes[-1] and len(host.seq_lens) <= self.max_seqs
                and len(host.sample_indices) <= self.max_sample_rows)

    def attention_meta(self, size: int) -> AttentionMetadata:
        rows, m = self.rows(size), self.meta
        return AttentionMetadata(
            slot_mapping=self.tokens.slot_mapping[:size], block_tables=m.block_tables[:rows],
            seq_lens=m.seq_lens[:rows], query_start_loc=m.query_start_loc[:rows + 1],
            max_query_len=size, max_seq_len=self.max_model_len)

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sampling rows' logits and draws, and all `size` rows' final hidden states
        (an output, so that prompt logprobs can read it after the replay: `hidden`)."""
        hidden = self._hidden(size)
        sampled = self.meta.sample_rows[:self.sample_rows(size)]
        return *self._logits_and_draws(hidden.index_select(0, sampled)), hidden

    def size_for(self, num_tokens: int) -> int:
        """The padded token count a step of num_tokens replays."""
        return next(s for s in self.sizes if s >= num_tokens)

    def hidden(self, num_tokens: int) -> torch.Tensor:
        """Final hidden states [num_tokens, n_embd] of the last `run` of num_tokens tokens,
        valid until the next replay of that size."""
        return self.outputs[self.size_for(num_tokens)][2][:num_tokens]

    def run(self, host: HostInputs, sources: list[int], prev_tokens: torch.Tensor | None,
            draw_inputs: DrawInputs, write_drafts: WriteDrafts | None = None,
            follow: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the sampling rows' logits and draws (as DecodeGraphs.run). `write_drafts`
        writes device-side drafts into the token ids before the replay; `follow` False:
        the follower's graph is skipped."""
        size = self.size_for(len(host.token_ids))
        rows, sample_rows = self.rows(size), self.sample_rows(size)
        after_copy = None if write_drafts is None else (
            lambda: write_drafts(self.tokens.token_ids))
        self._replay(size, lambda stager: stager.write(host, sources, draw_inputs, size, rows,
                                                       sample_rows),
                     prev_tokens, rows, after_copy, follow)
        num_samples = len(host.sample_indices)
        logits, drawn, _ = self.outputs[size]
        return logits[:num_samples], drawn[:num_samples]


class MixedStager:
    """Writes a step with prompt tokens into one pinned mirror's views, padded to `size`
    tokens (token 0, position 0, slot -1), `rows` sequences (query start at the real token
    count, seq_len 0) and `sample_rows` sampling rows (row 0, greedy; `rows` unless given)."""

    def __init__(self, tokens: SimpleNamespace, meta: SimpleNamespace):
        self.tokens, self.meta = tokens, meta
        n = len(tokens.token_ids)
        self._own_token = np.arange(n, 2 * n)  # token_source of each row's own token id

    def write(self, host: HostInputs, sources: list[int], draw_inputs: DrawInputs, size: int,
              rows: int, sample_rows: int | None = None) -> None:
        """`sources[s]` >= 0: sequence s's one new token is a placeholder, row sources[s] of
        the previous step's samples."""
        t, m = self.tokens, self.meta
        sample_rows = sample_rows or rows
        tokens, seqs, samples = len(host.token_ids), len(host.seq_lens), len(host.sample_indices)
        np.maximum(host.token_ids, 0, out=t.token_ids[:tokens])  # placeholders: prev_tokens
        t.positions[:tokens] = host.positions
        t.slot_mapping[:tokens] = host.slot_mapping
        t.token_source[:size] = self._own_token[:size]
        sources = np.asarray(sources)
        placeholders = np.flatnonzero(sources >= 0)
        t.token_source[host.query_start_loc[placeholders]] = sources[placeholders]
        t.token_ids[tokens:size] = 0
        t.positions[tokens:size] = 0
        t.slot_mapping[tokens:size] = -1
        stage_draw_inputs(t, draw_inputs, sample_rows)
        m.query_start_loc[:seqs + 1] = host.query_start_loc
        m.query_start_loc[seqs + 1:rows + 1] = tokens
        m.seq_lens[:seqs] = host.seq_lens
        m.seq_lens[seqs:rows] = 0
        m.sample_rows[:samples] = host.sample_indices
        m.sample_rows[samples:sample_rows] = 0
        m.block_tables[:seqs] = host.block_tables
