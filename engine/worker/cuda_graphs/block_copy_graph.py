"""A step's block copies (SchedulerOutput.block_copies: forked beams' copies of their parents'
partial last blocks) replayed from one CUDA graph: the pairs go through a pinned mirror into
a device buffer, and the graph's kernel (Ops.copy_staged_blocks) reads their count there.
A step then costs the host one copy and one replay, where block_copy.copy_blocks takes an
upload (four torch calls), a gather and a scatter (~0.2 ms of host time on the H100 node).

    staging (pinned)  n | src_0 .. src_n-1 ... | dst_0 .. dst_n-1 ...  ─copy─▶  pairs (device)
    graph: copy_staged_blocks(KV storage, pairs)
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.worker.cuda_graphs.graph_set import capture_graph


class BlockCopyGraph:
    def __init__(self, copy_staged_blocks: Callable, storage: torch.Tensor, max_pairs: int):
        """`storage`: the KV caches' (block_copy.allocate_kv_caches); `max_pairs`: the most
        copies a step may hold (one per forked sequence: max_num_seqs)."""
        self.storage, self.max_pairs = storage, max_pairs
        self._copy = copy_staged_blocks
        pin = storage.is_cuda
        self._staging = torch.zeros(1 + 2 * max_pairs, dtype=torch.int64, pin_memory=pin)
        self._pairs = self._staging.to(storage.device)
        self._copied = torch.cuda.Event() if pin else None
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

    def run(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Queue block_copy.copy_blocks(caches, copies) without waiting."""
        count = len(copies)
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the staging
        staging = self._staging.numpy()
        staging[0] = count
        pairs = np.array(copies, dtype=np.int64).reshape(count, 2)
        staging[1:1 + count] = pairs[:, 0]
        staging[1 + self.max_pairs:1 + self.max_pairs + count] = pairs[:, 1]
        self._pairs.copy_(self._staging, non_blocking=True)  # whole: one contiguous copy
        if self._copied is not None:
            self._copied.record()
        self.graph.replay()
        self.steps_copied += 1
