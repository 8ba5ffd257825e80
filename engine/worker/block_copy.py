"""Copy on write of KV blocks: a step's `SchedulerOutput.block_copies`, applied before its
forward (a forked beam's copy of its parent's partial last block)."""
from __future__ import annotations

import torch

from engine.worker.models.gpt2 import KVCache


def copy_blocks(kv_caches: list[KVCache], copies: tuple[tuple[int, int], ...]) -> None:
    """Block dst of every layer's K and V becomes a copy of block src, for each (src, dst):
    one multi-tensor copy over all of them (on CUDA, a launch or two instead of one per cache
    tensor), queued on the device without waiting. No dst is another pair's src."""
    caches = [cache for layer in kv_caches for cache in layer]
    torch._foreach_copy_([cache[dst] for _, dst in copies for cache in caches],
                         [cache[src] for src, _ in copies for cache in caches])
