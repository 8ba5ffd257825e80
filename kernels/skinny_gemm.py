"""Weight-streaming GEMM for skinny activations: act(x @ W^T + b) for x with M <= 16 rows,
optionally with the residual add and LayerNorm that precede it fused into its prologue.

At small decode batches a linear layer is pure weight traffic (N*K*2 bytes for 2*M*N*K FLOPs),
so the kernel tiles W and lets the few rows of x ride along:

    W [N, K]           program (n, s) streams rows n*BN..(n+1)*BN of W over its K range once,
    |###|###|###|      coalesced along K, pipelined through shared memory (num_stages)
    x [M <= 16, K]     all rows, padded to 16 for tl.dot
    acc [BN, 16] fp32  += W_tile @ x_tile^T   (W is the tensor-core M side, 64 rows)

When the N / BN tiles cannot fill the GPU (gpt2 c_proj: 768 / 64 = 12 tiles on 132 SMs) K is
split across programs. Each writes its fp32 partial; the last to arrive at the tile's counter
(kernels/arrival_counters.py) sums them in split order and applies bias and GELU, so the
whole layer is one launch.

With a norm, x is the branch output and the kernel computes LayerNorm(x + residual) on the fly:
every program first takes the M rows' mean and rstd over all of K (a few KB, from L2), then
normalises each x tile as it loads it. Program (0, 0) also writes x + residual, the new
residual stream. Decode then needs no separate add + LayerNorm launch before QKV and FC.
The model uses this kernel only for the shapes where it measured faster than the unfused
path on the running GPU (kernels/linear.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.layers import add_layer_norm
from kernels.arrival_counters import arrive_last, counters_for, reset_counter
from kernels.device_info import num_sms
from kernels.gelu import gelu_tanh

MAX_M = 16
BLOCK_N = 64
MAX_BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4
PROGRAMS_PER_SM = 2


class AddNorm(NamedTuple):
    """LayerNorm(x + residual) with these parameters, applied to the GEMM's input."""
    residual: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


@triton.jit
def _epilogue(acc, bias_ptr, offs_n, n_ok, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """acc: [BN, M] fp32 sums, columns indexed by offs_n along axis 0."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if GELU:
        acc = gelu_tanh(acc)
    return acc


@triton.jit
def _add_norm_stats(x_ptr, res_ptr, sum_ptr, K, stride_xm, eps, write_sum,
                    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, K_POW2: tl.constexpr):
    """mean and rstd [BLOCK_M] of the ROWS (= M) rows of x + residual (rounded to x's dtype
    first, as the unfused add is), each row loaded whole; padding rows get 0. Stores the sum
    if write_sum."""
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, K_POW2)
    ok = cols < K
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.zeros([BLOCK_M], tl.float32)
    for r in tl.static_range(ROWS):
        s = (tl.load(x_ptr + r * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
             + tl.load(res_ptr + r * stride_xm + cols, mask=ok, other=0.0).to(tl.float32))
        s = s.to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + r * stride_xm + cols, s, mask=cols < tl.where(write_sum, K, 0))
        s = s.to(tl.float32)
        row_mean = tl.sum(s, axis=0) / K
        centered = tl.where(ok, s - row_mean, 0.0)
        row_rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / K + eps)
        mean = tl.where(offs_m == r, row_mean, mean)
        rstd = tl.where(offs_m == r, row_rstd, rstd)
    return mean, rstd


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                   res_ptr, ln_w_ptr, ln_b_ptr, sum_ptr, eps, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                   NORM: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                   K_POW2: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    if NORM:
        mean, rstd = _add_norm_stats(x_ptr, res_ptr, sum_ptr, K, stride_xm, eps,
                                     (tile == 0) & (split == 0), BLOCK_M, ROWS, K_POW2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # BLOCK_K divides K: no mask along K, 16 B loads
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        x_offs = offs_m[None, :] * stride_xm + offs_k[:, None]
        x_t = tl.load(x_ptr + x_offs, mask=m_ok[None, :], other=0.0)
        if NORM:
            s = x_t.to(tl.float32) + tl.load(res_ptr + x_offs, mask=m_ok[None, :],
                                             other=0.0).to(tl.float32)
            s = s.to(x_ptr.dtype.element_ty).to(tl.float32)
            gamma = tl.load(ln_w_ptr + offs_k).to(tl.float32)
            beta = tl.load(ln_b_ptr + offs_k).to(tl.float32)
            x_t = ((s - mean[None, :]) * rstd[None, :] * gamma[:, None]
                   + beta[:, None]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    mask = n_ok[:, None] & m_ok[None, :]
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:
        part_offs = offs_m[None, :] * N + offs_n[:, None]
        num_splits = tl.num_programs(1)
        tl.store(part_ptr + split * M * N + part_offs, acc, mask=mask)
        if arrive_last(counter_ptr + tile, num_splits):
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(num_splits):
                acc += tl.load(part_ptr + s * M * N + part_offs, mask=mask, other=0.0,
                               cache_modifier=".cg")
            reset_counter(counter_ptr + tile)
            y = _epilogue(acc, bias_ptr, offs_n, n_ok, HAS_BIAS, GELU)
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        y = _epilogue(acc, bias_ptr, offs_n, n_ok, HAS_BIAS, GELU)
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _k_per_split(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """K range per program: about PROGRAMS_PER_SM programs per SM, whole BLOCK_K steps."""
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms, num_tiles), k // block_k))
    return triton.cdiv(k // block_k, splits) * block_k


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gelu: bool,
            norm: AddNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    (m, k), n = x.shape, weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert k % 16 == 0, "K must be a multiple of 16 (every GPT-2 width is)"
    block_k = next(b for b in (MAX_BLOCK_K, 64, 32, 16) if k % b == 0)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None
    if norm is not None:
        assert x.is_contiguous() and norm.residual.is_contiguous()
        assert norm.residual.shape == x.shape
        summed = torch.empty_like(x)
    if m == 0:
        return out, summed
    num_tiles = triton.cdiv(n, BLOCK_N)
    k_per_split = _k_per_split(num_tiles, k, block_k, num_sms(x.device))
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    counters = counters_for(x.device, num_tiles) if splits > 1 else out
    bias_arg = out if bias is None else bias
    res, ln_w, ln_b, eps = norm if norm is not None else (x, x, x, 0.0)
    _skinny_kernel[(num_tiles, splits)](
        x, weight, bias_arg, out, part, counters, res, ln_w, ln_b,
        out if summed is None else summed, eps, m, n, k, k_per_split, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, GELU=gelu,
        NORM=norm is not None, SPLIT=splits > 1, BLOCK_M=MAX_M, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k, ROWS=m, K_POW2=triton.next_power_of_2(k), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out, summed


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gelu: bool = False) -> torch.Tensor:
    """x [M, K] with M <= 16, weight [N, K] (F.linear layout) -> act(x @ weight.T + bias)."""
    return _launch(x, weight, bias, gelu, None)[0]


def skinny_add_norm_linear(x: torch.Tensor, norm: AddNorm, weight: torch.Tensor,
                           bias: torch.Tensor | None = None, gelu: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (act(LayerNorm(x + residual) @ weight.T + bias), x + residual) in one launch."""
    return _launch(x, weight, bias, gelu, norm)


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (F.gelu(y, approximate="tanh") if gelu else y).to(x.dtype)


def skinny_add_norm_linear_reference(x: torch.Tensor, norm: AddNorm, weight: torch.Tensor,
                                     bias: torch.Tensor | None = None, gelu: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = add_layer_norm(x, norm.residual, norm.weight, norm.bias, norm.eps)
    return skinny_linear_reference(normed, weight, bias, gelu), summed
