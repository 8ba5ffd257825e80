"""8-bit weight-only linears (W8A16): act(x @ W^T + b) with W stored as

    data [N, K] int8 or float8_e4m3fn, scale [N] float32:  W[n] = scale[n] * data[n]

The activations, bias and output stay in x's dtype. One kernel serves every batch size: the
skinny weight-streaming GEMM of kernels/skinny_gemm.py (read it first: tiling, split-K with
arrival counters, the residual add + LayerNorm folded into the dot in its affine form), with
three changes:

  - each W tile is loaded 8-bit and converted in registers to x's dtype for the dot, which
    is exact (every int8 and e4m3 value is an fp16 and a bf16 value); it accumulates in fp32.
    At small batches the kernel streams half the bytes of a 16-bit W.
  - the epilogue first multiplies the accumulator's row n by scale[n], then runs the skinny
    epilogue (LayerNorm's correction, bias, GELU): every column of the accumulator (x's rows,
    and the norm's gamma and beta columns) is linear in W, so this equals the product with
    the dequantized W.
  - a third grid axis tiles M. Up to MAX_TILE_M rows ride in one x tile as in the skinny GEMM,
    so batches up to 64 stream W once; more rows (prefill, large batches) take 64 x 128 GEMM
    tiles. There the weights' bytes still halve; the MMA work is the 16-bit GEMM's, on
    Triton's tiles rather than cuBLAS's. The norm is fused up to MAX_M rows (it needs two
    more x columns); beyond, the add + LayerNorm kernel runs first.

Tile shapes follow the batch and N (`tile_shape`), from sweeps on an H100. References:
`quant_linear_reference`, `quant_add_norm_linear_reference` (and the engine's
`engine.worker.layers.linear` on a QuantizedWeight).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.arrival_counters import counters_for
from kernels.device_info import num_sms
from kernels.layernorm import add_layer_norm
from kernels.pdl import pdl_options, pdl_prologue_prefetching
from kernels.skinny_gemm import (MAX_M, AddNorm, TileConfig, _block_n, _block_row_bytes,
                                 _block_rows, _epilogue, _norm_operands, _prefetchable,
                                 _row_centres, _splits, skinny_linear_reference, split_k_sum)

MAX_TILE_M = 64  # rows up to which x rides in one tile, W streamed once (as in the skinny GEMM)
# 17 to MAX_TILE_M rows: W tiles of 32 rows, K steps of up to 256, no fused norm and no PDL.
# Over gpt2-xl's four int8 linears on an H100 (whole layers in CUDA graphs, 17-64 rows, 24
# tiles with and without PDL), the best fixed tile: 42-58 us a layer against 54-76 for the
# small-batch rule
MID_TILE = TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=3, min_split_steps=2)
MID_X_TILE_BYTES = 32 << 10  # x's tile a stage: fp32 rows (64 KB at K step 256) would not fit
# more rows: a GEMM tile (prefill); W's 64 rows x 128 bytes and x's 128 x 128 fp16 a stage.
# The best mean over gpt2's and gpt2-xl's int8 linears at 512 rows on an H100 (1.01x each
# shape's best of 24 tiles, 1.07x at worst; 128 x 64 x 8 warps: 1.62x)
LARGE_BLOCK_M = 128
LARGE_TILE = TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, min_split_steps=4)


def tile_shape(m: int, n: int, sms: int, norm: bool = False, x_bytes: int = 2
               ) -> tuple[int, TileConfig]:
    """BLOCK_M and the tile config for M = m rows of x (and 2 more columns with a fused norm,
    which only m <= MAX_M takes) and N output channels on `sms` SMs. Up to MAX_M rows: one x
    tile of a power of two >= 16 columns, W tile rows 64 if that gives tiles for half the SMs,
    else 32; two warps up to 4 rows, else four; a K step of 128 (the best on GPT-2's shapes in
    scripts/sweep_skinny.py --quantization). Then MID_TILE up to MAX_TILE_M, its K step cut
    to keep x's tile (x_bytes an element) within MID_X_TILE_BYTES; LARGE_TILE beyond."""
    if m > MAX_TILE_M:
        return LARGE_BLOCK_M, LARGE_TILE
    block_m = max(16, triton.next_power_of_2(m + 2 if norm else m))
    if m > MAX_M:
        return block_m, MID_TILE._replace(
            block_k=min(MID_TILE.block_k, MID_X_TILE_BYTES // (block_m * x_bytes)))
    return block_m, TileConfig(block_n=64 if triton.cdiv(n, 64) >= sms // 2 else 32,
                               block_k=128,
                               num_warps=2 if m <= 4 else 4, num_stages=3,
                               min_split_steps=2)


def _uses_pdl(m: int) -> bool:
    """PDL (kernels/pdl.py) except at MID_TILE's rows, where launching without it made
    gpt2-xl's four int8 linears 58 us at 64 rows against 72 (H100, whole layers in graphs)."""
    return not MAX_M < m <= MAX_TILE_M


@triton.jit
def _widen(w, other):
    """8-bit W in the dtype of the dot's other operand, exactly: fp8 directly (packed e4m3 ->
    f16/bf16 conversions); int8 to fp16 by its bits (the bits w + 0x6480 are the fp16
    1152 + w, in [1024, 2048) where fp16's step is 1: integer adds, no int-to-float
    conversion), int8 to bf16 through fp32 (the interpreter's direct cast is wrong)."""
    if w.dtype.is_int8():
        if other.dtype == tl.float16:
            return (w.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        w = w.to(tl.float32)
    return w.to(other.dtype)


@triton.jit
def _plain_loop(x_ptr, w_rows, n_ok, rows, M, k_lo, k_hi, stride_xm, acc,
                BLOCK_K: tl.constexpr):
    """acc += W8[:, k_lo:k_hi] @ x[rows, k_lo:k_hi]^T, W8 widened to x's dtype."""
    for k0 in range(k_lo, k_hi, BLOCK_K):  # BLOCK_K divides K: no mask along K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        x_t = tl.load(x_ptr + rows[None, :] * stride_xm + offs_k[:, None],
                      mask=(rows < M)[None, :], other=0.0)
        acc = tl.dot(_widen(w, x_t), x_t, acc, input_precision="ieee")
    return acc


@triton.jit
def _norm_loop(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, w_rows, n_ok, cols, M, k_lo, k_hi,
               stride_xm, write_sum, acc, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """skinny_gemm's affine-form loop (one M tile: cols are the rows), W8 widened to the
    dot's dtype. Returns acc and the sums of d = s - centre and d^2; writes s if write_sum."""
    row_ok = (cols < M)[None, :]
    centre = _row_centres(x_ptr, res_ptr, cols, M, stride_xm)
    d_lanes = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    d_sq_lanes = tl.zeros([BLOCK_K, BLOCK_M], tl.float32)
    s, gamma, beta = _norm_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr,
                                    k_lo + tl.arange(0, BLOCK_K), cols, M, stride_xm, k_hi)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        s_next, gamma_next, beta_next = _norm_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr,
                                                       offs_k + BLOCK_K, cols, M, stride_xm,
                                                       k_hi)
        tl.store(sum_ptr + cols[None, :] * stride_xm + offs_k[:, None],
                 s.to(sum_ptr.dtype.element_ty),
                 mask=(cols < tl.where(write_sum, M, 0))[None, :])
        d = tl.where(row_ok, s - centre[None, :], 0.0)
        d_lanes += d
        d_sq_lanes += d * d
        x_t = tl.where(row_ok, gamma * d, 0.0)
        x_t = tl.where((cols == M)[None, :], gamma, x_t)
        x_t = tl.where((cols == M + 1)[None, :], beta, x_t).to(sum_ptr.dtype.element_ty)
        acc = tl.dot(_widen(w, x_t), x_t, acc, input_precision="ieee")
        s, gamma, beta = s_next, gamma_next, beta_next
    return acc, tl.sum(d_lanes, axis=0), tl.sum(d_sq_lanes, axis=0)


@triton.jit
def _scaled_epilogue(acc, scale_ptr, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, rows, M,
                     HAS_BIAS: tl.constexpr, GELU: tl.constexpr, NORM: tl.constexpr):
    """The per-channel scale, then the skinny epilogue (module doc)."""
    acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    return _epilogue(acc, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, rows, M, HAS_BIAS, GELU,
                     NORM)


@triton.jit
def _quant_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, stats_ptr,
                         counter_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, eps, M, N, K,
                         k_per_split, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                         GELU: tl.constexpr, NORM: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (n, s, m): W rows n*BN.., K split s, x rows m*BM.. (NORM: one M tile)."""
    pdl_prologue_prefetching(USE_PDL, PREFETCH,
                             _block_rows(w_ptr, N, k_per_split, stride_wn, BLOCK_N),
                             _block_row_bytes(w_ptr, K, k_per_split))
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if NORM:
        acc, d_sum, d_sq = _norm_loop(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, w_rows, n_ok,
                                      rows, M, k_lo, k_hi, stride_xm, tile == 0, acc, BLOCK_M,
                                      BLOCK_K)
    else:
        acc = _plain_loop(x_ptr, w_rows, n_ok, rows, M, k_lo, k_hi, stride_xm, acc, BLOCK_K)
        d_sum = tl.zeros([BLOCK_M], tl.float32)
        d_sq = tl.zeros([BLOCK_M], tl.float32)
    out_ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    out_mask = n_ok[:, None] & (rows < M)[None, :]
    if SPLIT:
        counter = tl.program_id(2) * tl.num_programs(0) + tile
        last, acc, d_sum, d_sq = split_k_sum(acc, d_sum, d_sq, part_ptr, stats_ptr,
                                             counter_ptr + counter, tile, split, offs_n, n_ok,
                                             rows, M, N, NORM, BLOCK_N, BLOCK_M)
        if last:
            y = _scaled_epilogue(acc, scale_ptr, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok,
                                 rows, M, HAS_BIAS, GELU, NORM)
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        y = _scaled_epilogue(acc, scale_ptr, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, rows,
                             M, HAS_BIAS, GELU, NORM)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def _launch(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            gelu: bool, norm: AddNorm | None, config: TileConfig | None,
            compile_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    (m, k), n = x.shape, data.shape[0]
    assert data.dtype in (torch.int8, torch.float8_e4m3fn) and scale.dtype == torch.float32
    assert data.shape[1] == k and scale.shape == (n,) and x.stride(1) == 1 and data.stride(1) == 1
    assert k % 16 == 0, "K must be a multiple of 16 (every GPT-2 width is)"
    assert m * max(k, n) < 2**31, "row offsets are int32"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None
    if norm is not None:
        assert m <= MAX_M and x.is_contiguous() and norm.residual.is_contiguous()
        assert norm.residual.shape == x.shape
        summed = torch.empty_like(x)
    if m == 0:
        return out, summed
    sms = num_sms(x.device)
    block_m, default = tile_shape(m, n, sms, norm is not None, x.element_size())
    config = config or default
    block_k = next(b for b in (256, 128, 64, 32, 16) if b <= config.block_k and k % b == 0)
    block_n = config.block_n or _block_n(n, sms)
    num_tiles, m_tiles = triton.cdiv(n, block_n), triton.cdiv(m, block_m)
    splits = _splits(num_tiles * m_tiles, k // block_k, sms, config)
    k_per_split = triton.cdiv(k // block_k, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    part_rows = m if norm is None else m + 2
    part = torch.empty((splits, part_rows, n), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    stats = torch.empty((num_tiles, splits, 2, block_m), dtype=torch.float32, device=x.device) \
        if splits > 1 and norm is not None else out
    counters = counters_for(x.device, num_tiles * m_tiles) if splits > 1 else out
    res, ln_w, ln_b, eps = norm if norm is not None else (x, x, x, 0.0)
    grid = (num_tiles, splits, m_tiles)
    kernel = (functools.partial(_quant_linear_kernel.warmup, grid=grid) if compile_only
              else _quant_linear_kernel[grid])
    kernel(
        x, data, scale, out if bias is None else bias, out, part, stats, counters, res, ln_w,
        ln_b, out if summed is None else summed, eps, m, n, k, k_per_split, x.stride(0),
        data.stride(0), out.stride(0), HAS_BIAS=bias is not None, GELU=gelu,
        NORM=norm is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        PREFETCH=m_tiles == 1 and _prefetchable(data),
        **(pdl_options(x.device) if _uses_pdl(m) else {"USE_PDL": False}))
    return out, summed


def quant_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, gelu: bool = False,
                 config: TileConfig | None = None) -> torch.Tensor:
    """x [M, K], data [N, K] 8-bit, scale [N] float32 -> act(x @ (scale * data).T + bias), in
    x's dtype; config None: by M (tile_shape)."""
    return _launch(x, data, scale, bias, gelu, None, config)[0]


def quant_add_norm_linear(x: torch.Tensor, norm: AddNorm, data: torch.Tensor,
                          scale: torch.Tensor, bias: torch.Tensor | None = None,
                          gelu: bool = False, config: TileConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(LayerNorm(x + residual) @ (scale * data).T + bias), x + residual): one launch up
    to MAX_M rows, else the add + LayerNorm kernel and quant_linear."""
    if x.shape[0] > MAX_M:
        normed, summed = add_layer_norm(x, norm.residual, norm.weight, norm.bias, norm.eps)
        return quant_linear(normed, data, scale, bias, gelu, config), summed
    return _launch(x, data, scale, bias, gelu, norm, config)


def compile_quant_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None, gelu: bool, norm: AddNorm | None,
                         config: TileConfig | None) -> None:
    """Compile, without launching, the variant quant_linear (norm None) or
    quant_add_norm_linear would launch (Triton's warmup; AsyncCompileMode: its pool)."""
    _launch(x, data, scale, bias, gelu, norm, config, compile_only=True)


class Weight8(NamedTuple):
    """An 8-bit weight as the dispatch reads one (the engine's QuantizedWeight's fields)."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def random_weight8(n: int, k: int, dtype: torch.dtype, device: torch.device) -> Weight8:
    """A random [N, K] weight in 8-bit `dtype`, for timing (values do not change speed)."""
    data = (torch.randn(n, k, device=device) * 32).clamp(-127, 127).to(dtype)
    return Weight8(data, torch.full((n,), k ** -0.5 / 32, device=device))


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: scale[n] * data[n]."""
    return data.float() * scale[:, None]


def quant_linear_reference(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    return skinny_linear_reference(x, dequantize(data, scale), bias, gelu)


def quant_add_norm_linear_reference(x: torch.Tensor, norm: AddNorm, data: torch.Tensor,
                                    scale: torch.Tensor, bias: torch.Tensor | None = None,
                                    gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + norm.residual
    normed = F.layer_norm(summed, (summed.shape[-1],), norm.weight, norm.bias, norm.eps)
    return quant_linear_reference(normed, data, scale, bias, gelu), summed
