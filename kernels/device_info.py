"""Device facts the kernels size their grids by, looked up once: a properties query costs
more host time than the kernels it sizes."""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessor count; 4 under the interpreter (CPU), so split paths still run."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
