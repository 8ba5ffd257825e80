"""Device time of queued work, by CUDA events (what the benchmarks and the startup GEMM table
measure with)."""
from __future__ import annotations

from typing import Callable

import torch


def cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    """Mean milliseconds of device time per call of `fn`, over `repeats` calls queued back to
    back after everything queued before them has finished."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
