"""LayerNorm and fused residual-add + LayerNorm, one program per row (4 rows in big batches).

A GPT-2 row (768..1600 features) fits in registers: each program reads it once and writes
once. Statistics are fp32 whatever the input dtype. The fused variant also writes the new
residual stream `x + residual`, rounded to the input dtype first, as the unfused reference
normalizes it. References: `engine.worker.layers.layer_norm` / `add_layer_norm`.

For an fp8 GEMM's input (kernels/linear.py: QKV and FC at 65 rows or more) the fused variant
quantizes the rows it writes: each row rounded to the input dtype (as the reference's
activations are), then scaled by its own amax to e4m3's range and written as e4m3 beside its
float32 scale. Reference: `engine.worker.layers.quantize_rows_fp8` of those activations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue

ROWS_PER_PROGRAM = 4
MANY_ROWS = 1024
FP8_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (engine.worker.layers.FP8_MAX)
FP8_MIN_AMAX = tl.constexpr(1e-12)  # engine.worker.layers.FP8_MIN_AMAX: zeros stay 0


@triton.jit
def _round_to_e4m3(v):
    """fp32 v in [-448, 448] rounded to the nearest e4m3 value (ties to even), as fp32: the
    cast that follows is then exact whatever its own rounding (the interpreter's truncates).
    e4m3 keeps 3 mantissa bits: its step is 2^(e - 3) at exponent e >= -6, 2^-9 below."""
    exponent = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    units = v / step  # exact: a power of two
    units = (units + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds |units| < 2^22 to even
    return units * step


@triton.jit
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, sum_ptr, scale_ptr, n_rows,
                       n_cols, eps, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr,
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
    if FP8_OUT:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the activations the reference has
        amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)
        scale = tl.maximum(amax, FP8_MIN_AMAX) / FP8_MAX
        tl.store(scale_ptr + rows, scale, mask=rows < n_rows)
        y = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(y, scale[:, None]), -FP8_MAX),
                                      FP8_MAX))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, bias, eps, fp8_out=False):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    res2 = x2 if residual is None else residual.reshape(-1, n_cols).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float8_e4m3fn if fp8_out else x.dtype,
                      device=x.device)
    summed = x2 if residual is None else torch.empty_like(x2)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device) \
        if fp8_out else x2
    n_rows = x2.shape[0]
    block = triton.next_power_of_2(n_cols)
    # one row is too little traffic per program to hide a load's latency: big batches take more
    rows = ROWS_PER_PROGRAM if n_rows >= MANY_ROWS else 1
    if n_rows > 0:
        _layer_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2, res2, weight, bias, out, summed, scale, n_rows, n_cols, eps,
            HAS_RESIDUAL=residual is not None, FP8_OUT=fp8_out, ROWS=rows, BLOCK=block,
            num_warps=min(max(rows * block // 256, 1), 8), **pdl_options(x.device))
    return out, summed, scale


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    return _launch(x, None, weight, bias, eps)[0].view(x.shape)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (LayerNorm(x + residual), x + residual) from one read of each input."""
    out, summed, _ = _launch(x, residual, weight, bias, eps)
    return out.view(x.shape), summed.view(x.shape)


def add_layer_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [M, K] -> (q, scale, x + residual): LayerNorm(x + residual) quantized by
    rows, q float8_e4m3fn [M, K] and scale float32 [M, 1], in one launch."""
    q, summed, scale = _launch(x, residual, weight, bias, eps, fp8_out=True)
    return q, scale, summed
