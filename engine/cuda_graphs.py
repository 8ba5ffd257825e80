"""CUDA graphs for decode steps: the forward pass and the logits, captured once per padded
batch size and replayed, so a decode step costs one graph launch instead of ~10 kernel
launches per layer from Python.

Inputs live in static device buffers that every graph reads. A step of B sequences replays
the smallest captured size >= B; rows B.. are padding that can do no harm:

    row        0    1    2    3    4  | 5    6    7        (B = 5, graph for 8)
    slot       s0   s1   s2   s3   s4 | -1   -1   -1       -1: KV store skips the row
    seq_len    c0   c1   c2   c3   c4 | 1    1    1        attends to block 0, slot 0
    block row  ...                    | 0 0 0 ...         (finite: the cache is zeroed)

The attention metadata of a graph is fixed at capture: max_seq_len is the model's context
length, so the split-KV grid covers any sequence, and the kernels mask by seq_lens.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata
from engine.batch import ScheduledSequence
from engine.inputs import DecodeStager

if TYPE_CHECKING:
    from engine.model_runner import SampledOnDevice
    from engine.sampler import DrawInputs

def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(8 if max_num_seqs > 8 else max_num_seqs, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, max_model_len: int,
                 device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n = self.sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        # two packed buffers, so a step is two host-to-device copies, not seven:
        #   int64 [7, n]:  previous step's sampled tokens (device-filled) | known token ids |
        #                  positions | slot mapping | token source | draw seed |
        #                  draw temperature (float64 bits)
        #   int32 flat:    seq_lens (n) | block tables (n x max_blocks_per_seq)
        # The graph gathers its input ids from rows 0-1 by token source: a known token's own
        # entry in row 1, or a placeholder's sampled token in row 0.
        self._ids64 = torch.zeros(7, n, dtype=torch.int64, device=device)
        self._ids32 = torch.zeros(n * (1 + max_blocks_per_seq), dtype=torch.int32, device=device)
        # Two pinned staging buffers, used in turn: when step N+1 is staged (scheduling
        # ahead), step N's copies may still be queued behind step N-1 on the device, so
        # N+1 writes the buffer N-1 used, whose copies are done (N-1 was waited for).
        self._staging = [_PinnedStaging(self._ids64, self._ids32, max_blocks_per_seq,
                                        block_size) for _ in range(2)]
        self._steps_staged = 0
        (self.prev_tokens, _, self.positions, self.slot_mapping, self.token_source,
         self.draw_seeds, temperature_bits) = self._ids64
        self.draw_temperature = temperature_bits.view(torch.float64)
        self._token_pool = self._ids64[:2].view(-1)
        self.seq_lens = self._ids32[:n]
        self.block_tables = self._ids32[n:].view(n, max_blocks_per_seq)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.drawn: dict[int, torch.Tensor] = {}  # each row's draw from its logits, captured too

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size], query_start_loc=self.query_start_loc[:size + 1],
            max_query_len=1, max_seq_len=self.max_model_len)

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a graph of this size records, run eagerly: the logits, and each row's token
        drawn from them at its staged temperature and seed (Ops.sample)."""
        token_ids = self._token_pool.index_select(0, self.token_source[:size])
        hidden = self.model(token_ids, self.positions[:size], self.kv_caches, self._meta(size))
        logits = self.model.compute_logits(hidden)
        return logits, self.model.ops.sample(logits, self.draw_temperature[:size],
                                             self.draw_seeds[:size])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first, all sharing one memory pool. Returns seconds."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            self.forward(size)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size], self.drawn[size] = self.forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def run(self, seqs: list[ScheduledSequence], sources: list[int],
            last_sampled: SampledOnDevice | None,
            draw_inputs: DrawInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for this decode batch; sources[i] >= 0 is the row of sequence i's
        placeholder token in last_sampled. Returns logits [B, vocab] and each row's token
        drawn at its temperature and seed (`draw_inputs`), views valid until the next
        replay."""
        batch = len(seqs)
        size = next(s for s in self.sizes if s >= batch)
        staging = self._staging[self._steps_staged % 2]
        self._steps_staged += 1
        staging.stager.write(seqs, size, sources, draw_inputs)
        if last_sampled is not None and max(sources) >= 0:
            sampled = last_sampled.token_ids
            self.prev_tokens[:len(sampled)].copy_(sampled, non_blocking=True)
        # whole rows: a column slice is not contiguous, and torch would stage it through
        # pageable memory, whose copy waits for the step still running on the device
        self._ids64[1:].copy_(staging.ids64[1:], non_blocking=True)
        used = self.sizes[-1] + size * self.max_blocks_per_seq
        self._ids32[:used].copy_(staging.ids32[:used], non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:batch], self.drawn[size][:batch]


class _PinnedStaging:
    """Pinned host mirrors of the graphs' two input buffers, with the stager that fills them."""

    def __init__(self, ids64: torch.Tensor, ids32: torch.Tensor, max_blocks_per_seq: int,
                 block_size: int):
        self.ids64 = torch.zeros_like(ids64, device="cpu").pin_memory()
        self.ids32 = torch.zeros_like(ids32, device="cpu").pin_memory()
        self.stager = DecodeStager(self.ids64.numpy(), self.ids32.numpy(), max_blocks_per_seq,
                                   block_size)
