"""CUDA graphs for whole steps: the forward pass, the logits and each row's draw, captured
once per padded size and replayed, so a step costs one graph launch instead of ~10 kernel
launches per layer from Python. (Eager steps were bound by those launches: on an H100 a
512-token prompt's TTFT was 10.4 ms for gpt2 and 36.8 ms for gpt2-xl, ~0.8 ms per layer in
both, though gpt2-xl's layers do 12x the work; docs/benchmarks/h100/s4/latency.log.)

Two sets share one memory pool:

* `DecodeGraphs`: one token per sequence, per padded batch size. A step of B sequences
  replays the smallest captured size >= B; rows B.. are padding that can do no harm:

    row        0    1    2    3    4  | 5    6    7        (B = 5, graph for 8)
    slot       s0   s1   s2   s3   s4 | -1   -1   -1       -1: KV store skips the row
    seq_len    c0   c1   c2   c3   c4 | 1    1    1        attends to block 0, slot 0
    block row  ...                    | 0 0 0 ...         (finite: the cache is zeroed)

  Their attention metadata is fixed at capture: max_seq_len is the model's context length,
  so the split-KV grid covers any sequence, and the kernels mask by seq_lens.

* `MixedGraphs`: steps with prompt tokens (prefill chunks, with or without decodes), per
  padded token count N, holding R = min(N, max_num_seqs) sequence rows:

    tokens     t0 .. t(T-1)             | T .. N-1: token 0, position 0, slot -1
    sequences  s0 .. s(S-1)             | S .. R-1: no new tokens, seq_len 0
    samples    the sampling sequences' last token rows | padding: row 0, greedy

  The prefill attention grid depends only on tensor shapes (kernels.paged_attention), so one
  capture serves every step that fits; padding token rows leave attention unwritten and
  stay in their own rows through every row-wise op after it.

Each set reads two packed device buffers (copies from pinned memory: two per step):

    int64 [7, n]   previous step's sampled tokens (device-filled) | known token ids |
                   positions | slot mapping | token source | draw seed | draw temperature
                   (float64 bits)
    int32 flat     per-sequence metadata and block tables (the stager's layout)

A graph gathers its input ids from rows 0-1 by token source: a known token's own entry in
row 1, or a placeholder's sampled token in row 0.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from engine.core.batch import ScheduledSequence
from engine.worker.attention import AttentionMetadata
from engine.worker.inputs import DecodeStager, HostInputs, MixedStager
from engine.worker.sampler import DrawInputs

MIN_MIXED_TOKENS = 16  # the smallest mixed-step graph (tl.dot tiles need 16 rows)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes: 1, 2, 4, 8, then steps of 8 up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(8 if max_num_seqs > 8 else max_num_seqs, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """Mixed-step token counts: powers of two from 16, then the token budget itself."""
    sizes = [1 << p for p in range(4, max_num_batched_tokens.bit_length())
             if 1 << p < max_num_batched_tokens]
    return sizes + [max(max_num_batched_tokens, MIN_MIXED_TOKENS)]


class _GraphSet:
    """Graphs of one kind, one per padded size, reading the packed buffers (see the module
    docstring) that two pinned staging mirrors fill in turn: when step N+1 is staged
    (scheduling ahead), step N's copies may still be queued behind step N-1 on the device,
    so N+1 writes the mirror N-1 used, whose copies are done (N-1 was waited for).
    A subclass defines forward(size): what its graph of that size records, run eagerly
    (logits and each row's draw)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: list[int],
                 ids32_len: int, device: torch.device,
                 make_stager: Callable[[np.ndarray, np.ndarray], object]):
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        n = sizes[-1]
        self._ids64 = torch.zeros(7, n, dtype=torch.int64, device=device)
        self._ids64[3] = -1  # slots: nothing is stored while the graphs are captured
        self._ids32 = torch.zeros(ids32_len, dtype=torch.int32, device=device)
        self._staging = [_PinnedStaging(self._ids64, self._ids32, make_stager)
                         for _ in range(2)]
        self._steps_staged = 0
        (self.prev_tokens, _, self.positions, self.slot_mapping, self.token_source,
         self.draw_seeds, temperature_bits) = self._ids64
        self.draw_temperature = temperature_bits.view(torch.float64)
        self._token_pool = self._ids64[:2].view(-1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.drawn: dict[int, torch.Tensor] = {}  # each row's draw from its logits

    def _input_ids(self, size: int) -> torch.Tensor:
        return self._token_pool.index_select(0, self.token_source[:size])

    def _logits_and_draws(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw reads the model-dtype logits (widened exactly in the kernel): no float32
        copy of every row in the graph (46 us at batch 256 on an H100); the torch sampler
        widens them when a batch needs it."""
        logits = self.model.lm_head(hidden)
        rows = logits.shape[0]
        return logits, self.model.ops.sample(logits, self.draw_temperature[:rows],
                                             self.draw_seeds[:rows])

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every size, largest first, into `pool` (None: a new one). Returns the
        pool, for the next set to share."""
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size], self.drawn[size] = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return pool

    def _replay(self, size: int, stage: Callable, prev_tokens: torch.Tensor | None,
                ids32_used: int) -> None:
        """stage(stager) fills the next pinned mirror; then copy it and the previous step's
        sampled tokens (when placeholders read them) in, and replay."""
        staging = self._staging[self._steps_staged % 2]
        self._steps_staged += 1
        stage(staging.stager)
        if prev_tokens is not None:
            self.prev_tokens[:len(prev_tokens)].copy_(prev_tokens, non_blocking=True)
        # whole rows: a column slice is not contiguous, and torch would stage it through
        # pageable memory, whose copy waits for the step still running on the device
        self._ids64[1:].copy_(staging.ids64[1:], non_blocking=True)
        self._ids32[:ids32_used].copy_(staging.ids32[:ids32_used], non_blocking=True)
        self.graphs[size].replay()


class DecodeGraphs(_GraphSet):
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device):
        sizes = capture_sizes(max_num_seqs)
        n = sizes[-1]
        # int32: seq_lens (n) | block tables (n x max_blocks_per_seq)
        super().__init__(model, kv_caches, sizes, n * (1 + max_blocks_per_seq), device,
                         lambda ids64, ids32: DecodeStager(ids64, ids32, max_blocks_per_seq,
                                                           block_size))
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq
        self.seq_lens = self._ids32[:n]
        self.block_tables = self._ids32[n:].view(n, max_blocks_per_seq)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_seq_len=self.max_model_len)
        hidden = self.model(self._input_ids(size), self.positions[:size], self.kv_caches, meta)
        return self._logits_and_draws(hidden)

    def run(self, seqs: list[ScheduledSequence], sources: list[int],
            prev_tokens: torch.Tensor | None,
            draw_inputs: DrawInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this decode batch; sources[i] >= 0 is the row of sequence i's
        placeholder token in prev_tokens (the previous step's samples). Returns logits [B, vocab] and each row's token
        drawn at its temperature and seed (`draw_inputs`), views valid until the next
        replay."""
        batch = len(seqs)
        size = next(s for s in self.sizes if s >= batch)
        self._replay(size, lambda stager: stager.write(seqs, size, sources, draw_inputs),
                     prev_tokens, self.max_batch + size * self.max_blocks_per_seq)
        return self.logits[size][:batch], self.drawn[size][:batch]


class MixedGraphs(_GraphSet):
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_batched_tokens: int,
                 max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device):
        sizes = mixed_capture_sizes(max_num_batched_tokens)
        self.max_seqs = max_num_seqs
        layout = MixedStager.layout(max_num_seqs, max_blocks_per_seq)
        super().__init__(model, kv_caches, sizes, layout["tables"][1], device,
                         lambda ids64, ids32: MixedStager(ids64, ids32, max_num_seqs,
                                                          max_blocks_per_seq))
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = max_blocks_per_seq
        (self.query_start_loc, self.seq_lens, self.sample_rows,
         self.block_tables) = MixedStager.segments(self._ids32, max_num_seqs, max_blocks_per_seq)
        self._ids32_base = layout["tables"][0]

    def rows(self, size: int) -> int:
        """Sequence rows of the graph for `size` tokens (a sequence has at least one)."""
        return min(size, self.max_seqs)

    def fits(self, host: HostInputs) -> bool:
        return len(host.token_ids) <= self.sizes[-1] and len(host.seq_lens) <= self.max_seqs

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows(size)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:rows],
            seq_lens=self.seq_lens[:rows], query_start_loc=self.query_start_loc[:rows + 1],
            max_query_len=size, max_seq_len=self.max_model_len)
        hidden = self.model(self._input_ids(size), self.positions[:size], self.kv_caches, meta)
        return self._logits_and_draws(hidden.index_select(0, self.sample_rows[:rows]))

    def run(self, host: HostInputs, sources: list[int], prev_tokens: torch.Tensor | None,
            draw_inputs: DrawInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this step (see `run` of DecodeGraphs); returns the logits and
        draws of its sampling sequences."""
        size = next(s for s in self.sizes if s >= len(host.token_ids))
        rows = self.rows(size)
        self._replay(size, lambda stager: stager.write(host, sources, draw_inputs, size, rows),
                     prev_tokens, self._ids32_base + rows * self.max_blocks_per_seq)
        num_samples = len(host.sample_indices)
        return self.logits[size][:num_samples], self.drawn[size][:num_samples]


class _PinnedStaging:
    """Pinned host mirrors of the graphs' two input buffers, with the stager that fills them."""

    def __init__(self, ids64: torch.Tensor, ids32: torch.Tensor,
                 make_stager: Callable[[np.ndarray, np.ndarray], object]):
        self.ids64 = torch.zeros_like(ids64, device="cpu").pin_memory()
        self.ids32 = torch.zeros_like(ids32, device="cpu").pin_memory()
        self.stager = make_stager(self.ids64.numpy(), self.ids32.numpy())
