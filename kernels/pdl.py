"""Programmatic dependent launch (PDL, Hopper and newer): kernel N+1's programs may become
resident once every program of kernel N has started; they block in `griddepcontrol.wait`
until N has finished and its writes are visible, so N+1's launch overlaps N's tail (a decode
step is dozens of short kernels):

    kernel N    |==== stream weights ====|tail|
    kernel N+1        (launched, resident)|wait|==== (reads N's output) ====|

The contract every kernel launched with PDL keeps: **no read of another kernel's output and
no write at all before the wait**, and every program reaches it (one that returns early still
waits first). Every kernel here calls `pdl_prologue` as its first statement, so a kernel
finishes only after its predecessor, and a normally launched kernel (cuBLAS, torch) after it
still sees everything before it. CUDA-graph capture keeps these edges.

`pdl_prologue_prefetching` also asks L2 for a kernel's weights (no kernel's output) between
the two, so they arrive while the kernel before it still runs; `pdl_prologue_loading` loads a
tile of them into registers there.

Set GPT2_SERVE_PDL=0 to launch normally, GPT2_SERVE_PREFETCH=0 to keep PDL but drop the
prefetch (for A/B timings); both are off on the CPU interpreter and on GPUs before Hopper.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def pdl_enabled(device: torch.device) -> bool:
    """GPT2_SERVE_PDL is read at each launch (a kernel captured in a CUDA graph keeps the
    launch it was captured with); the device's support is looked up once."""
    return os.environ.get("GPT2_SERVE_PDL", "1") != "0" and _pdl_supported(device)


@functools.lru_cache(maxsize=None)
def _pdl_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from triton.language.extra import cuda as triton_cuda
    # triton's `launch_pdl` launch option came with its gdc_* builtins
    return (hasattr(triton_cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def weight_prefetch_enabled(device: torch.device) -> bool:
    """Whether `pdl_prologue_prefetching` should prefetch (read at each launch, like PDL)."""
    return pdl_enabled(device) and os.environ.get("GPT2_SERVE_PREFETCH", "1") != "0"


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel taking a `USE_PDL: tl.constexpr` parameter."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """The first statement of every kernel here: let the next kernel launch, then block until
    the kernel before this one has finished and its writes are visible."""
    _launch_dependents(USE_PDL)
    _wait_for_previous(USE_PDL)


@triton.jit
def pdl_prologue_prefetching(USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, row_ptrs,
                             row_bytes):
    """pdl_prologue, and in between (if PREFETCH) one bulk L2 prefetch of row_bytes from each
    of row_ptrs: read-only data (weights), 16-byte aligned, row_bytes a multiple of 16."""
    _launch_dependents(USE_PDL)
    if PREFETCH:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                                  "=r,l,r", [row_ptrs.to(tl.int64), row_bytes], dtype=tl.int32,
                                  is_pure=False, pack=1)
    _wait_for_previous(USE_PDL)


@triton.jit
def pdl_prologue_loading(USE_PDL: tl.constexpr, LOAD: tl.constexpr, row_ptrs, row_ok, cols,
                         end):
    """pdl_prologue, and in between (if LOAD) the load of a tile of read-only data (weights):
    row_ptrs [R] + cols [C], zero in rows not row_ok and from column `end` on. Returns the
    [R, C] tile (zeros if not LOAD); issued before the wait, it overlaps the kernel before
    this one."""
    _launch_dependents(USE_PDL)
    ptrs = row_ptrs[:, None] + cols[None, :]
    if LOAD:
        tile = tl.load(ptrs, mask=row_ok[:, None] & (cols < end)[None, :], other=0.0)
    else:
        tile = tl.zeros(ptrs.shape, ptrs.dtype.element_ty)
    _wait_for_previous(USE_PDL)
    return tile


@triton.jit
def _launch_dependents(USE_PDL: tl.constexpr):
    """Own asm, marked impure: triton 3.6's gdc_launch_dependents is a pure op whose unused
    result the compiler may drop, leaving only the implicit trigger at program exit."""
    if USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_for_previous(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
