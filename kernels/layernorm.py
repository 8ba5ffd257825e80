"""LayerNorm and fused residual-add + LayerNorm, one program per row (4 rows in big batches).

A GPT-2 row (768..1600 features) fits in registers: each program reads it once and writes
once. Statistics are fp32 whatever the input dtype. The fused variant also writes the new
residual stream `x + residual`, rounded to the input dtype first, as the unfused reference
normalizes it. References: `engine.worker.layers.layer_norm` / `add_layer_norm`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue

ROWS_PER_PROGRAM = 4
MANY_ROWS = 1024


@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, n_rows, n_cols, eps,
                       HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # round once, as the unfused add does
        tl.store(sum_ptr + offs, x, mask=mask)
        x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok).to(tl.float32)[None, :]
    b = tl.load(b_ptr + cols, mask=col_ok).to(tl.float32)[None, :]
    y = centered * rstd[:, None] * w + b
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, bias, eps):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    res2 = x2 if residual is None else residual.reshape(-1, n_cols).contiguous()
    out = torch.empty_like(x2)
    summed = out if residual is None else torch.empty_like(x2)
    n_rows = x2.shape[0]
    block = triton.next_power_of_2(n_cols)
    # one row is too little traffic per program to hide a load's latency: big batches take more
    rows = ROWS_PER_PROGRAM if n_rows >= MANY_ROWS else 1
    if n_rows > 0:
        _layer_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2, res2, weight, bias, out, summed, n_rows, n_cols, eps,
            HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK=block,
            num_warps=min(max(rows * block // 256, 1), 8), **pdl_options(x.device))
    return out.view(x.shape), summed.view(x.shape)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    return _launch(x, None, weight, bias, eps)[0]


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (LayerNorm(x + residual), x + residual) from one read of each input."""
    return _launch(x, residual, weight, bias, eps)
