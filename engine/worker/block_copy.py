"""The paged KV cache's storage, and copy on write of its blocks: a step's
`SchedulerOutput.block_copies`, applied before its forward (a forked beam's copy of its
parent's partial last block)."""
from __future__ import annotations

import numpy as np
import torch

from engine.worker.inputs import upload
from engine.worker.models.gpt2 import KVCache


def allocate_kv_caches(num_layers: int, block_shape: tuple[int, ...], num_blocks: int,
                       dtype: torch.dtype, device: torch.device) -> list[KVCache]:
    """Each layer's (K, V), [num_blocks, *block_shape] each: views of one zeroed tensor
    [num_layers, 2, num_blocks, *block_shape], so that `copy_blocks` moves blocks of every
    layer at once. Zeroed, so never-written slots hold finite values for kernels that load
    whole blocks."""
    storage = torch.zeros((num_layers, 2, num_blocks, *block_shape), dtype=dtype,
                          device=device)
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(num_layers)]


def kv_storage(kv_caches: list[KVCache]) -> torch.Tensor:
    """The one tensor allocate_kv_caches made the caches views of."""
    storage = kv_caches[0][0]._base
    if storage is None or storage.shape[:2] != (len(kv_caches), 2):
        raise ValueError("copy_blocks needs caches from allocate_kv_caches")
    return storage


def copy_blocks(kv_caches: list[KVCache], copies: tuple[tuple[int, int], ...]) -> None:
    """Block dst of every layer's K and V becomes a copy of block src, for each (src, dst):
    one indexed read and one indexed write over the caches' storage (allocate_kv_caches) seen
    as one row per block of each layer's K or V, queued on the device without waiting (a
    strided copy per pair costs torch ~3x the host time). No dst is another pair's src, nor
    twice a dst."""
    storage = kv_storage(kv_caches)
    caches, num_blocks = 2 * len(kv_caches), storage.shape[2]
    rows = storage.view(caches * num_blocks, -1)
    first_rows = np.arange(caches)[:, None] * num_blocks  # block 0 of each cache
    src, dst = upload(first_rows[None] + np.array(copies).T[:, None], torch.int64,
                      storage.device).view(2, -1)  # one upload: [src rows, dst rows]
    rows.index_copy_(0, dst, rows.index_select(0, src))
