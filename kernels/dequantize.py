"""An 8-bit weight widened for a 16-bit GEMM: out[n, k] = data[n, k] * scale[n] in out's
dtype, each product in fp32 and rounded once, for the linears that run cuBLAS over a
dequantized 8-bit weight (kernels/linear.py: from 65 rows every int8 one, fp8's O and MLP
projection). A memory-bound copy: one byte read and two written per element. One program per
tile of ELEMENTS elements, its 8-bit tile loaded before the PDL wait (weights never depend on
the kernel before). Reference:
`engine.worker.layers.QuantizedWeight.dequantize`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue_loading

ELEMENTS = 8192  # a program's tile: 8 KB in, 16 KB out, enough bytes in flight per SM
WIDTHS = (512, 256, 128, 64)  # a tile's columns: the widest dividing K (GPT-2's K all take one)


@triton.jit
def _rows(BLOCK_N: tl.constexpr):
    return tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _cols(BLOCK_K: tl.constexpr):
    return tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    w = pdl_prologue_loading(USE_PDL, True, data_ptr + _rows(BLOCK_N).to(tl.int64) * K,
                             _rows(BLOCK_N) < N, _cols(BLOCK_K), K)
    rows, cols = _rows(BLOCK_N), _cols(BLOCK_K)
    ok = rows < N
    scale = tl.load(scale_ptr + rows, mask=ok, other=0.0)
    out = w.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (cols < K)[None, :])


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data int8 or float8_e4m3fn [N, K] (contiguous), scale float32 [N] -> [N, K] in dtype."""
    n, k = data.shape
    out = torch.empty(n, k, dtype=dtype, device=data.device)
    block_k = next((w for w in WIDTHS if k % w == 0), WIDTHS[-1])
    block_n = ELEMENTS // block_k
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](data, scale, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                             num_warps=4, **pdl_options(data.device))
    return out
