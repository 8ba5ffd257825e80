"""Weight-streaming GEMM for skinny activations: act(x @ W^T + b) for x with M <= 16 rows,
optionally with the residual add and LayerNorm that precede it fused in.

At small batches a linear is pure weight traffic, so the kernel tiles W and lets the few rows
of x ride along:

    W [N, K]           program (n, s) streams rows n*BN..(n+1)*BN of W over its K range once,
    |###|###|###|      coalesced along K, pipelined through shared memory (num_stages)
    x [M <= 16, K]     all rows, padded to BLOCK_M (>= 16) columns for tl.dot
    acc [BN, BLOCK_M]  += W_tile @ x_tile^T in fp32 (W is the tensor-core M side)

The tile config comes from a table measured at startup (kernels/linear.py). K is split across
programs towards two per SM when the tiles alone leave SMs idle; each writes its fp32 partial
and the last to arrive (kernels/arrival_counters.py) sums them in split order and applies
bias and GELU, so the whole layer is one launch.

With a norm, x is the branch output, s = x + residual, and LayerNorm(s) is folded into the dot
in its affine form, so no program waits for row statistics before streaming W. With d = s - c
for a rough row centre c (mean of the row's first 16 elements, so nothing large cancels):

    LayerNorm(s) @ W^T = rstd * (W (gamma d) - mean(d) * (W gamma)) + W beta

The x tile carries gamma*d for each row, then gamma and beta as two more columns; the loop
also sums d and d^2 for mean(d) and rstd, which the epilogue applies. Programs of tile 0 write
s, the new residual stream.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.device_info import num_sms
from kernels.gelu import gelu_tanh
from kernels.pdl import pdl_options, pdl_prologue_prefetching, weight_prefetch_enabled

MAX_M = 16
PROGRAMS_PER_SM = 2
PREFETCH_MAX_BYTES = 5 << 20  # see _prefetchable


class TileConfig(NamedTuple):
    """Launch shape: W tile rows (the dot's M side, >= 16), K step, warps, pipeline stages,
    and the fewest K steps a split may have (fewer splits: a shorter arrival chain)."""
    block_n: int = 0  # 0: the largest of 64, 32, 16 giving tiles for half the SMs or more
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    min_split_steps: int = 4


# the tile configs the startup table tries per shape (scripts/sweep_skinny.py picks them)
TILE_CANDIDATES = (TileConfig(32, 256, 2, 4, 2), TileConfig(64, 256, 4, 4, 2),
                   TileConfig(16, 256, 4, 4, 2), TileConfig(32, 128, 2, 4, 1),
                   TileConfig(16, 128, 2, 4, 1))


class AddNorm(NamedTuple):
    """LayerNorm(x + residual) with these parameters, applied to the GEMM's input."""
    residual: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


@triton.jit
def _sum_rows(x_ptr, res_ptr, offs, row_ok):
    """s = x + residual at offs, rounded to x's dtype as the unfused add's output is; fp32."""
    x = tl.load(x_ptr + offs, mask=row_ok, other=0.0)
    s = x.to(tl.float32) + tl.load(res_ptr + offs, mask=row_ok, other=0.0).to(tl.float32)
    return s.to(x.dtype).to(tl.float32)


@triton.jit
def _row_centres(x_ptr, res_ptr, cols, M, stride_xm):
    """[BLOCK_M] mean of each row's first 16 elements of s: a centre near the row's mean, so
    the sums below never cancel the large common part of s."""
    head = cols[None, :] * stride_xm + tl.arange(0, 16)[:, None]
    return tl.sum(_sum_rows(x_ptr, res_ptr, head, (cols < M)[None, :]), axis=0) / 16


@triton.jit
def _plain_loop(x_ptr, w_rows, n_ok, cols, M, k_lo, k_hi, stride_xm, acc,
                BLOCK_K: tl.constexpr):
    """acc += W[:, k_lo:k_hi] @ x[:, k_lo:k_hi]^T; both loads feed the dot directly, so the
    compiler pipelines them (num_stages)."""
    for k0 in range(k_lo, k_hi, BLOCK_K):  # BLOCK_K divides K: no mask along K, 16 B loads
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        x_t = tl.load(x_ptr + cols[None, :] * stride_xm + offs_k[:, None],
                      mask=(cols < M)[None, :], other=0.0)
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    return acc


@triton.jit
def _norm_operands(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, offs_k, cols, M, stride_xm, k_hi):
    """s [BK, BLOCK_M], gamma and beta [BK, 1] at offs_k, all fp32; zero from k_hi on (the
    prefetch after the last step)."""
    k_ok = offs_k < k_hi
    s = _sum_rows(x_ptr, res_ptr, cols[None, :] * stride_xm + offs_k[:, None],
                  (cols < M)[None, :] & k_ok[:, None])
    gamma = tl.load(ln_w_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
    beta = tl.load(ln_b_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[:, None]
    return s, gamma, beta


@triton.jit
def _norm_loop(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, w_rows, n_ok, cols, M, k_lo, k_hi,
               stride_xm, write_sum, acc, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The affine-form loop (module doc). Its dot input is computed, not loaded, so the
    compiler does not pipeline it: each step loads the next step's operands itself. Returns
    acc and the sums of d = s - centre and d^2 [BLOCK_M]; writes s to sum_ptr if write_sum."""
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
                 s.to(sum_ptr.dtype.element_ty), mask=(cols < tl.where(write_sum, M, 0))[None, :])
        d = tl.where(row_ok, s - centre[None, :], 0.0)
        d_lanes += d
        d_sq_lanes += d * d
        x_t = tl.where(row_ok, gamma * d, 0.0)
        x_t = tl.where((cols == M)[None, :], gamma, x_t)
        x_t = tl.where((cols == M + 1)[None, :], beta, x_t)
        acc = tl.dot(w, x_t.to(sum_ptr.dtype.element_ty), acc, input_precision="ieee")
        s, gamma, beta = s_next, gamma_next, beta_next
    return acc, tl.sum(d_lanes, axis=0), tl.sum(d_sq_lanes, axis=0)


@triton.jit
def _epilogue(acc, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, cols, M,
              HAS_BIAS: tl.constexpr, GELU: tl.constexpr, NORM: tl.constexpr):
    """acc: [BN, BLOCK_M] fp32 dot sums, output columns indexed by offs_n along axis 0;
    d_sum, d_sq: [BLOCK_M] sums of d = s - centre and of d^2 over K (NORM only).
    Returns columns < M finished."""
    if NORM:
        mean_d = d_sum / K
        rstd = 1.0 / tl.sqrt(tl.maximum(d_sq / K - mean_d * mean_d, 0.0) + eps)
        w_gamma = _column(acc, cols, M)[:, None]
        w_beta = _column(acc, cols, M + 1)[:, None]
        acc = rstd[None, :] * (acc - mean_d[None, :] * w_gamma) + w_beta
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if GELU:
        acc = gelu_tanh(acc)
    return acc


@triton.jit
def _column(acc, cols, c):
    return tl.sum(tl.where(cols[None, :] == c, acc, 0.0), axis=1)


@triton.jit
def _block_rows(w_ptr, N, k_per_split, stride_wn, BLOCK_N: tl.constexpr):
    """[BLOCK_N] starts of this program's rows of W in its K range (rows past N clamped to
    the last): what it prefetches before the PDL wait."""
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    return w_ptr + rows.to(tl.int64) * stride_wn + tl.program_id(1) * k_per_split


@triton.jit
def _block_row_bytes(w_ptr, K, k_per_split):
    k_lo = tl.program_id(1) * k_per_split
    return tl.minimum(K - k_lo, k_per_split) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, stats_ptr, counter_ptr,
                   res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, eps, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                   NORM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                   PREFETCH: tl.constexpr):
    pdl_prologue_prefetching(USE_PDL, PREFETCH,
                             _block_rows(w_ptr, N, k_per_split, stride_wn, BLOCK_N),
                             _block_row_bytes(w_ptr, K, k_per_split))
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if NORM:
        acc, d_sum, d_sq = _norm_loop(x_ptr, res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, w_rows, n_ok,
                                      cols, M, k_lo, k_hi, stride_xm, tile == 0, acc, BLOCK_M,
                                      BLOCK_K)
    else:
        acc = _plain_loop(x_ptr, w_rows, n_ok, cols, M, k_lo, k_hi, stride_xm, acc, BLOCK_K)
        d_sum = tl.zeros([BLOCK_M], tl.float32)
        d_sq = tl.zeros([BLOCK_M], tl.float32)
    out_ptrs = out_ptr + cols[None, :] * stride_om + offs_n[:, None]
    out_mask = n_ok[:, None] & (cols < M)[None, :]
    if SPLIT:
        last, acc, d_sum, d_sq = split_k_sum(acc, d_sum, d_sq, part_ptr, stats_ptr,
                                             counter_ptr + tile, tile, split, offs_n, n_ok,
                                             cols, M, N, NORM, BLOCK_N, BLOCK_M)
        if last:
            y = _epilogue(acc, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, cols, M, HAS_BIAS,
                          GELU, NORM)
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        y = _epilogue(acc, d_sum, d_sq, K, eps, bias_ptr, offs_n, n_ok, cols, M, HAS_BIAS,
                      GELU, NORM)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def split_k_sum(acc, d_sum, d_sq, part_ptr, stats_ptr, counter_ptr, tile, split, offs_n, n_ok,
                cols, M, N, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store this K split's partial tile (acc [BLOCK_N, BLOCK_M], and with NORM its
    LayerNorm sums d_sum, d_sq [BLOCK_M] over the x columns `cols`) among tile `tile`'s. The
    program that arrives last at `counter_ptr` returns (True, every split's partials summed
    in split order), then resets the counter; the others return False and their own."""
    num_splits = tl.num_programs(1)
    part_rows = M + 2 * NORM  # the columns the epilogue reads
    part_offs = cols[None, :] * N + offs_n[:, None]
    part_mask = n_ok[:, None] & (cols < part_rows)[None, :]
    tl.store(part_ptr + split * part_rows * N + part_offs, acc, mask=part_mask)
    stats = stats_ptr + tile * num_splits * 2 * BLOCK_M + cols
    if NORM:
        tl.store(stats + split * 2 * BLOCK_M, d_sum)
        tl.store(stats + split * 2 * BLOCK_M + BLOCK_M, d_sq)
    last = arrive_last(counter_ptr, num_splits)
    if last:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        d_sum = tl.zeros([BLOCK_M], tl.float32)
        d_sq = tl.zeros([BLOCK_M], tl.float32)
        for sp in range(num_splits):
            acc += tl.load(part_ptr + sp * part_rows * N + part_offs, mask=part_mask,
                           other=0.0, cache_modifier=".cg")
            if NORM:
                d_sum += tl.load(stats + sp * 2 * BLOCK_M, cache_modifier=".cg")
                d_sq += tl.load(stats + sp * 2 * BLOCK_M + BLOCK_M, cache_modifier=".cg")
        reset_counter(counter_ptr)
    return last, acc, d_sum, d_sq


def _block_n(n: int, sms: int) -> int:
    """The default W tile rows: the largest of 64, 32 whose tiles cover half the SMs, else 16."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) >= sms // 2), 16)


def _splits(num_tiles: int, k_steps: int, sms: int, config: TileConfig) -> int:
    """Split K towards PROGRAMS_PER_SM programs per SM (more loads in flight), while each
    split keeps min_split_steps K steps."""
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, num_tiles),
                      k_steps // config.min_split_steps))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool,
            norm: AddNorm | None, config: TileConfig = TileConfig(), compile_only: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    (m, k), n = x.shape, weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert k % 16 == 0, "K must be a multiple of 16 (every GPT-2 width is)"
    block_k = next(b for b in (config.block_k, 64, 32, 16) if k % b == 0 and b <= config.block_k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None
    if norm is not None:
        assert x.is_contiguous() and norm.residual.is_contiguous()
        assert norm.residual.shape == x.shape
        summed = torch.empty_like(x)
    if m == 0:
        return out, summed
    sms = num_sms(x.device)
    block_n = config.block_n or _block_n(n, sms)
    block_m = max(16, triton.next_power_of_2(m + 2 if norm is not None else m))
    num_tiles = triton.cdiv(n, block_n)
    splits = _splits(num_tiles, k // block_k, sms, config)
    k_per_split = triton.cdiv(k // block_k, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    part_rows = m if norm is None else m + 2
    part = torch.empty((splits, part_rows, n), dtype=torch.float32, device=x.device) \
        if splits > 1 else out
    stats = torch.empty((num_tiles, splits, 2, block_m), dtype=torch.float32, device=x.device) \
        if splits > 1 and norm is not None else out
    counters = counters_for(x.device, num_tiles) if splits > 1 else out
    bias_arg = out if bias is None else bias
    res, ln_w, ln_b, eps = norm if norm is not None else (x, x, x, 0.0)
    grid = (num_tiles, splits)
    kernel = (functools.partial(_skinny_kernel.warmup, grid=grid) if compile_only
              else _skinny_kernel[grid])
    kernel(
        x, weight, bias_arg, out, part, stats, counters, res, ln_w, ln_b,
        out if summed is None else summed, eps, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GELU=gelu,
        NORM=norm is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=config.num_warps, num_stages=config.num_stages,
        PREFETCH=_prefetchable(weight), **pdl_options(x.device))
    return out, summed


def _prefetchable(weight: torch.Tensor) -> bool:
    """Prefetch W where the launch is latency-bound (small weights), not where it streams at
    bandwidth (there the prefetch contends with the kernel before it). The bulk prefetch
    needs 16-byte aligned rows (K % 16 == 0 makes every K range a multiple of 16 bytes)."""
    return (weight_prefetch_enabled(weight.device)
            and weight.numel() * weight.element_size() <= PREFETCH_MAX_BYTES
            and weight.data_ptr() % 16 == 0 and weight.stride(0) * weight.element_size() % 16 == 0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gelu: bool = False, config: TileConfig = TileConfig()) -> torch.Tensor:
    """x [M, K] with M <= 16, weight [N, K] (F.linear layout) -> act(x @ weight.T + bias)."""
    return _launch(x, weight, bias, gelu, None, config)[0]


def skinny_add_norm_linear(x: torch.Tensor, norm: AddNorm, weight: torch.Tensor,
                           bias: torch.Tensor | None = None, gelu: bool = False,
                           config: TileConfig = TileConfig()
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (act(LayerNorm(x + residual) @ weight.T + bias), x + residual) in one launch."""
    return _launch(x, weight, bias, gelu, norm, config)


def compile_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool,
                   norm: AddNorm | None, config: TileConfig) -> None:
    """Compile, without launching, the variant skinny_linear (norm None) or
    skinny_add_norm_linear would launch (Triton's warmup; AsyncCompileMode: its pool)."""
    _launch(x, weight, bias, gelu, norm, config, compile_only=True)


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (F.gelu(y, approximate="tanh") if gelu else y).to(x.dtype)


def skinny_add_norm_linear_reference(x: torch.Tensor, norm: AddNorm, weight: torch.Tensor,
                                     bias: torch.Tensor | None = None, gelu: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + norm.residual
    normed = F.layer_norm(summed, (summed.shape[-1],), norm.weight, norm.bias, norm.eps)
    return skinny_linear_reference(normed, weight, bias, gelu), summed
