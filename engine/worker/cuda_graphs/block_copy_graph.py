"""A step's block copies (SchedulerOutput.block_copies: forked beams' copies of their parents'
partial last blocks) replayed from one CUDA graph, whose kernel (Ops.copy_staged_blocks) reads
the pairs and their count in a device buffer. Where block_copy.copy_blocks takes an upload
(four torch calls), a gather and a scatter (~0.2 ms of host time on the H100 node), a step
costs the host:

- a decode step's: the replay alone. The pairs travel in the decode graphs' packed inputs
  (their `block_copies` segment, DecodeGraphs), copied in with the step's other inputs;
- any other step's (`run`): one copy from the graph's own pinned mirror, and the replay.

    staged  n | src_0 .. src_n-1 ... | dst_0 .. dst_n-1 ...  ─copy─▶  pairs (device)
    graph: copy_staged_blocks(KV storage, pairs)
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.worker.cuda_graphs.graph_set import capture_graph


def stage_pairs(staged: np.ndarray, copies: tuple[tuple[int, int], ...]) -> None:
    """Write `copies` into a pairs array [1 + 2P] (int64): their count, then P sources, then
    P destinations, as copy_staged_blocks reads them."""
    count, max_pairs = len(copies), (len(staged) - 1) // 2
    staged[0] = count
    pairs = np.array(copies, dtype=np.int64).reshape(count, 2)
    staged[1:1 + count] = pairs[:, 0]
    staged[1 + max_pairs:1 + max_pairs + count] = pairs[:, 1]


class BlockCopyGraph:
    def __init__(self, copy_staged_blocks: Callable, storage: torch.Tensor, max_pairs: int,
                 pairs: torch.Tensor | None = None):
        """`storage`: the KV caches' (block_copy.allocate_kv_caches); `max_pairs`: the most
        copies a step may hold (one per forked sequence: max_num_seqs). `pairs`: the device
        buffer [1 + 2 max_pairs] the graph reads, when another copy fills it (DecodeGraphs'
        inputs: then only `replay` serves); None: a buffer of its own, filled by `run`."""
        self.storage, self.max_pairs = storage, max_pairs
        self._copy = copy_staged_blocks
        self._staging = self._copied = None
        if pairs is None:
            pin = storage.is_cuda
            self._staging = torch.zeros(1 + 2 * max_pairs, dtype=torch.int64, pin_memory=pin)
            pairs = self._staging.to(storage.device)
            self._copied = torch.cuda.Event() if pin else None
        self._pairs = pairs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps_copied = 0  # steps whose copies the graph made

    def capture(self, pool=None):
        """The graph, in `pool` (None: a new one), over a count of 0; returns the pool."""
        self.graph, pool, _ = capture_graph(self.record, pool)
        return pool

    def record(self) -> None:
        """What the graph runs."""
        self._copy(self.storage, self._pairs)

    def takes(self, storage: torch.Tensor, copies: tuple[tuple[int, int], ...]) -> bool:
        return storage is self.storage and len(copies) <= self.max_pairs

    def replay(self) -> None:
        """Queue the copies of the pairs in the device buffer, without waiting."""
        self.graph.replay()
        self.steps_copied += 1

    def run(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Queue block_copy.copy_blocks(caches, copies) without waiting, through the graph's
        own buffer."""
        if self._staging is None:
            raise RuntimeError("this block-copy graph reads pairs another copy stages")
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the staging
        stage_pairs(self._staging.numpy(), copies)
        self._pairs.copy_(self._staging, non_blocking=True)  # whole: one contiguous copy
        if self._copied is not None:
            self._copied.record()
        self.replay()
