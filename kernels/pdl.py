"""Programmatic dependent launch (PDL, Hopper and newer): a kernel starts while the one before
it on the stream is still finishing, and waits for that kernel's results only where it reads
them.

A captured decode step at batch 1 is ~70 short kernels, each a few microseconds of ramp-up
(launch, first loads in flight) and tail. Launched with PDL, kernel N+1's programs become
resident as soon as every program of kernel N has started, run their prologue (index maths,
the skinny GEMM's L2 prefetch of its weights, which no kernel writes) under kernel N's tail,
and then block in `griddepcontrol.wait` until kernel N has finished and its writes are visible:

    kernel N    |==== stream weights ====|tail|
    kernel N+1        |prologue, prefetch|wait |==== (reads N's output) ====|

The contract every kernel launched with PDL keeps: **no read of another kernel's output and
no write at all before `wait_for_inputs`**, and every program reaches it (a program that
returns early still waits first). So a kernel finishes only after its predecessor has, and a
normally launched kernel (cuBLAS, torch) after it still sees everything before it. CUDA-graph
capture keeps these edges (programmatic dependencies in the graph).

Set GPT2_SERVE_PDL=0 to launch normally (for A/B timings); off on the CPU interpreter and on
GPUs before Hopper.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def pdl_enabled(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("GPT2_SERVE_PDL", "1") == "0":
        return False
    from triton.language.extra import cuda as triton_cuda
    return (hasattr(triton_cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel taking a `USE_PDL: tl.constexpr` parameter."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def allow_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs start (they wait for this kernel where they read it).
    Own asm, marked impure: triton 3.6's gdc_launch_dependents is a pure op whose unused
    result the compiler may drop, leaving only the implicit trigger at program exit."""
    if USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible."""
    if USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """The start of a kernel with nothing to do before its inputs are ready."""
    allow_dependents(USE_PDL)
    wait_for_inputs(USE_PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the cache lines at `ptrs` to be brought into L2 (no registers, no wait): used
    before `wait_for_inputs` on data no kernel writes (weights). CUDA only."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
