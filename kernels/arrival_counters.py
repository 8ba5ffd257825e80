"""Arrival counters for split reductions finished inside one launch.

A kernel that splits one output across programs (split-K GEMM, split-KV attention) needs no
second launch: each program writes its partial, then bumps the output's counter; the last to
arrive combines every partial in split order (deterministic) and resets the counter to zero:

    split 0 ──write partial──▶ atomic +1 ─▶ 0 ≠ last: done
    split 2 ──write partial──▶ atomic +1 ─▶ 1 ≠ last: done
    split 1 ──write partial──▶ atomic +1 ─▶ 2 = last: sum partials 0,1,2 ─▶ output, counter = 0

Kernels on one stream run in turn and leave their counters at zero, so one buffer per device
serves them all. It is allocated on first use, which must precede any CUDA-graph capture.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_COUNTERS = 1 << 16


@functools.lru_cache(maxsize=None)
def arrival_counters(device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("arrival counters must be allocated before CUDA-graph capture; "
                           "run the kernel once eagerly first")
    return torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)


def counters_for(device: torch.device, count: int) -> torch.Tensor:
    if count > MAX_COUNTERS:
        raise ValueError(f"{count} split outputs exceed the {MAX_COUNTERS} arrival counters")
    return arrival_counters(device)


@triton.jit
def arrive_last(counter_ptr, num_splits):
    """After this program stored its partial: True for the program that arrives last, which
    then sees every other partial. The barrier makes all of this program's threads' stores
    precede the atomic; acq_rel makes them visible to (and the others' visible in) the last."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    return arrived == num_splits - 1


@triton.jit
def reset_counter(counter_ptr):
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
