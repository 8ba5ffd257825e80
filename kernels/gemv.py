"""Matrix-vector linears on the CUDA cores for one or two rows of x: act(LN?(x) @ W^T + b) with
W at 16 bits, or 8 bits with per-channel scales (W[n] = scale[n] * data[n]).

At M = 1 the skinny GEMM's tensor-core dot is 1/16 used and routes every W tile through
shared memory; here each thread loads W straight into registers in 16-byte vectors along K,
widens it to fp32 and multiplies it with x's matching elements, accumulating a [M, BN, BK]
tile that is summed over K once, after the loop:

    W [N, K]          program (n, s): rows n*BN..(n+1)*BN of W over K range s
    x [M, K]          the same K slice for every row, from L1/L2
    acc [M, BN, BK]   += W_tile * x_slice      (fp32 FMAs, no reduction inside the loop)

With EARLY the program loads its first W tile before waiting for the kernel before it
(`pdl_prologue_loading`): weights never depend on it, so that load overlaps the previous
kernel's tail; the loop then loads each next tile before using the current one.

With a norm, x is the branch output and s = x + residual: every program reads its rows of s
whole (K <= MAX_NORM_K, from L2), takes their mean and variance in two passes in registers,
and normalises each slice as it streams W, rounding it to x's dtype as the unfused
add + LayerNorm kernel's output is. Program (0, 0) writes s, the new residual stream.

K is split across programs towards `programs_per_sm` per SM when the W tiles alone leave SMs
idle; the last to arrive sums the partials in split order (skinny_gemm.split_k_sum) and
applies the scale, bias and GELU. References: kernels.skinny_gemm's and
kernels.quant_linear's (the same contract at M <= 2).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import counters_for
from kernels.device_info import num_sms
from kernels.pdl import pdl_options, pdl_prologue_loading
from kernels.skinny_gemm import AddNorm, _epilogue, _sum_rows, split_k_sum

MAX_M = 2  # beyond, M FMAs a weight and M accumulators: the tensor-core kernels win
MAX_NORM_K = 4096  # the widest row a program normalises in registers (GPT-2: 1600)


class GemvConfig(NamedTuple):
    """W tile rows and K step, warps, pipeline stages, EARLY (module doc), and the programs
    per SM that K is split towards."""
    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1
    early: bool = True
    programs_per_sm: int = 2


@triton.jit
def widen_to_f32(w):
    """W exactly in fp32. int8 by its bits: w + 0x4B400000 is the fp32 bit pattern of
    12582912 + w (1.5 * 2^23, where fp32's step is 1), so an integer add and one subtraction
    replace the slower int-to-float conversion; e4m3 through the packed f16 conversion."""
    if w.dtype.is_int8():
        return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    if w.dtype.is_fp8():
        return w.to(tl.float16).to(tl.float32)
    return w.to(tl.float32)


@triton.jit
def _row_stats(x_ptr, res_ptr, sum_ptr, rows, M, K, stride_xm, write_sum,
               NORM_K: tl.constexpr):
    """Mean and variance [BLOCK_M] of each row of s = x + residual, by two passes over the
    whole row in registers; writes s to sum_ptr if write_sum."""
    cols = tl.arange(0, NORM_K)
    offs = rows[:, None] * stride_xm + cols[None, :]
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    s = _sum_rows(x_ptr, res_ptr, offs, ok)
    tl.store(sum_ptr + offs, s.to(sum_ptr.dtype.element_ty), mask=ok & (rows < tl.where(write_sum, M, 0))[:, None])
    mean = tl.sum(s, axis=1) / K
    d = tl.where(ok, s - mean[:, None], 0.0)
    return mean, tl.sum(d * d, axis=1) / K


@triton.jit
def _x_slice(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows, offs_k, k_ok, M, stride_xm, mean, rstd,
             NORM: tl.constexpr):
    """[BLOCK_M, BK] fp32 slice of x, or of LayerNorm(x + residual) rounded to x's dtype."""
    s, gamma, beta = x_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows, offs_k, k_ok, M,
                                stride_xm, NORM)
    return normed_slice(s, gamma, beta, mean, rstd, x_ptr.dtype.element_ty, NORM)


@triton.jit
def x_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows, offs_k, k_ok, M, stride_xm,
               NORM: tl.constexpr):
    """The loads of one K slice: (x, or with NORM s = x + residual, as [BLOCK_M, BK] fp32;
    gamma, beta [BK] fp32, zeros without NORM); zeros outside rows < M and k_ok."""
    offs = rows[:, None] * stride_xm + offs_k[None, :]
    ok = (rows < M)[:, None] & k_ok[None, :]
    if NORM:
        s = _sum_rows(x_ptr, res_ptr, offs, ok)
        gamma = tl.load(ln_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        beta = tl.load(ln_b_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        return s, gamma, beta
    zeros = tl.zeros(offs_k.shape, tl.float32)
    return tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32), zeros, zeros


@triton.jit
def normed_slice(s, gamma, beta, mean, rstd, dtype: tl.constexpr, NORM: tl.constexpr):
    """x_operands' slice as the linear multiplies it: x, or LayerNorm(s) rounded to dtype (as
    the unfused add + LayerNorm kernel's output is). Masked columns (gamma = beta = 0) give 0;
    rows past M are finite and never stored."""
    if NORM:
        normed = (s - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
        return normed.to(dtype).to(tl.float32)
    return s


@triton.jit
def _w_rows(w_ptr, stride_wn, BLOCK_N: tl.constexpr):
    """[BLOCK_N] starts of this program's rows of W (rows past N: masked by _n_ok)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return w_ptr + rows.to(tl.int64) * stride_wn


@triton.jit
def _n_ok(N, BLOCK_N: tl.constexpr):
    return tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N) < N


@triton.jit
def _split_start(k_per_split, BLOCK_K: tl.constexpr):
    """[BLOCK_K] columns of this program's first K step."""
    return tl.program_id(1) * k_per_split + tl.arange(0, BLOCK_K)


@triton.jit
def _split_end(K, k_per_split):
    return tl.minimum(K, (tl.program_id(1) + 1) * k_per_split)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, res_ptr,
                 ln_w_ptr, ln_b_ptr, sum_ptr, eps, M, N, K, k_per_split, stride_xm, stride_wn,
                 stride_om, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, SCALED: tl.constexpr,
                 NORM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
                 EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    w = pdl_prologue_loading(USE_PDL, EARLY, _w_rows(w_ptr, stride_wn, BLOCK_N),
                             _n_ok(N, BLOCK_N), _split_start(k_per_split, BLOCK_K),
                             _split_end(K, k_per_split))
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    k_lo = split * k_per_split
    k_hi = _split_end(K, k_per_split)
    w_rows = _w_rows(w_ptr, stride_wn, BLOCK_N)[:, None]
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        mean, var = _row_stats(x_ptr, res_ptr, sum_ptr, rows, M, K, stride_xm,
                               (tile == 0) & (split == 0), NORM_K)
        rstd = 1.0 / tl.sqrt(var + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        if EARLY:
            offs_next = offs_k + BLOCK_K
            w_next = tl.load(w_rows + offs_next[None, :],
                             mask=n_ok[:, None] & (offs_next < k_hi)[None, :], other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = _x_slice(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, rows, offs_k, k_ok, M, stride_xm, mean,
                     rstd, NORM)
        acc += widen_to_f32(w)[None, :, :] * x[:, None, :]
        if EARLY:
            w = w_next
    dots = tl.trans(tl.sum(acc, axis=2))  # [BLOCK_N, BLOCK_M], the skinny epilogue's layout
    none = tl.zeros([BLOCK_M], tl.float32)  # LayerNorm is applied to x: no sums to carry
    out_ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    out_mask = n_ok[:, None] & (rows < M)[None, :]
    last = True
    if SPLIT:
        last, dots, _, _ = split_k_sum(dots, none, none, part_ptr, part_ptr, counter_ptr + tile,
                                       tile, split, offs_n, n_ok, rows, M, N, False, BLOCK_N,
                                       BLOCK_M)
    if last:
        if SCALED:
            dots = dots * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
        y = _epilogue(dots, none, none, K, eps, bias_ptr, offs_n, n_ok, rows, M, HAS_BIAS,
                      GELU, False)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
            bias: torch.Tensor | None, gelu: bool, norm: AddNorm | None, config: GemvConfig,
            compile_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    (m, k), n = x.shape, weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert k % 16 == 0, "K must be a multiple of 16 (every GPT-2 width is)"
    assert (scale is None) == (weight.element_size() != 1), "8-bit weights need their scales"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None
    if norm is not None:
        assert k <= MAX_NORM_K and x.is_contiguous() and norm.residual.is_contiguous()
        assert norm.residual.shape == x.shape
        summed = torch.empty_like(x)
    if m == 0:
        return out, summed
    num_tiles, k_steps = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    splits = max(1, min(triton.cdiv(config.programs_per_sm * num_sms(x.device), num_tiles),
                        k_steps))
    k_per_split = triton.cdiv(k_steps, splits) * config.block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    counters = counters_for(x.device, num_tiles) if splits > 1 else out
    res, ln_w, ln_b, eps = norm if norm is not None else (x, x, x, 0.0)
    grid = (num_tiles, splits)
    kernel = (functools.partial(_gemv_kernel.warmup, grid=grid) if compile_only
              else _gemv_kernel[grid])
    kernel(x, weight, out if scale is None else scale, out if bias is None else bias, out, part,
           counters, res, ln_w, ln_b, out if summed is None else summed, eps, m, n, k,
           k_per_split, x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
           GELU=gelu, SCALED=scale is not None, NORM=norm is not None, SPLIT=splits > 1,
           BLOCK_M=triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
           NORM_K=triton.next_power_of_2(k) if norm is not None else 16, EARLY=config.early,
           num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x.device))
    return out, summed


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, gelu: bool = False,
                config: GemvConfig = GemvConfig()) -> torch.Tensor:
    """x [M <= 2, K], weight [N, K] (16-bit, or 8-bit with scale [N] float32) ->
    act(x @ (scale * weight).T + bias) in x's dtype."""
    return _launch(x, weight, scale, bias, gelu, None, config)[0]


def gemv_add_norm_linear(x: torch.Tensor, norm: AddNorm, weight: torch.Tensor,
                         scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         gelu: bool = False, config: GemvConfig = GemvConfig()
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(LayerNorm(x + residual) @ (scale * weight).T + bias), x + residual), one launch."""
    return _launch(x, weight, scale, bias, gelu, norm, config)


def compile_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                 bias: torch.Tensor | None, gelu: bool, norm: AddNorm | None,
                 config: GemvConfig) -> None:
    """Compile, without launching, the variant gemv_linear or gemv_add_norm_linear would
    launch (Triton's warmup; AsyncCompileMode: its pool)."""
    _launch(x, weight, scale, bias, gelu, norm, config, compile_only=True)
