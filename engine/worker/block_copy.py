"""The paged KV cache's storage, and copy on write of its blocks: a step's
`SchedulerOutput.block_copies`, applied before its forward (a forked beam's copy of its
parent's partial last block)."""
from __future__ import annotations

import torch

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


def copy_blocks(kv_caches: list[KVCache], copies: tuple[tuple[int, int], ...]) -> None:
    """Block dst of every layer's K and V becomes a copy of block src, for each (src, dst):
    one strided copy per pair over the caches' storage (allocate_kv_caches), queued on the
    device without waiting. No dst is another pair's src."""
    storage = kv_caches[0][0]._base
    if storage is None or storage.shape[:2] != (len(kv_caches), 2):
        raise ValueError("copy_blocks needs caches from allocate_kv_caches")
    for src, dst in copies:
        storage[:, :, dst].copy_(storage[:, :, src])
