"""Weight-streaming GEMM for skinny activations: act(x @ W^T + b) for x with M <= 16 rows.

At small decode batches a linear layer is pure weight traffic (N*K*2 bytes for 2*M*N*K FLOPs),
so the kernel tiles W and lets the few rows of x ride along:

    W [N, K]           program (n, s) streams rows n*BN..(n+1)*BN of W over its K range once,
    |###|###|###|      coalesced along K, pipelined through shared memory (num_stages)
    x [M <= 16, K]     all rows, padded to 16 for tl.dot
    acc [BN, 16] fp32  += W_tile @ x_tile^T   (W is the tensor-core M side, 64 rows)

When the N / BN tiles cannot fill the GPU (gpt2 c_proj: 768 / 64 = 12 tiles on 132 SMs) K is
split across programs and `_sum_splits_kernel` adds the fp32 partials; bias and GELU are
applied once, after the full sum. The model uses it only for the shapes where it measured
faster than cuBLAS on the running GPU (kernels/linear.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.device_info import num_sms
from kernels.gelu import gelu_tanh

MAX_M = 16
BLOCK_N = 64
MAX_BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4
PROGRAMS_PER_SM = 2


@triton.jit
def _epilogue(acc, bias_ptr, offs_n, n_ok, HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    """acc: [BN, M] fp32 sums, columns indexed by offs_n along axis 0."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if GELU:
        acc = gelu_tanh(acc)
    return acc


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    split = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # BLOCK_K divides K: no mask along K, 16 B loads
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                      mask=m_ok[None, :], other=0.0)
        acc = tl.dot(w, x_t, acc, input_precision="ieee")
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)
    else:
        y = _epilogue(acc, bias_ptr, offs_n, n_ok, HAS_BIAS, GELU)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_om,
                       HAS_BIAS: tl.constexpr, GELU: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + m) * N + offs_n, mask=n_ok, other=0.0)
    y = _epilogue(acc[:, None], bias_ptr, offs_n, n_ok, HAS_BIAS, GELU)
    tl.store(out_ptr + m * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None])


def _k_per_split(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """K range per program: about PROGRAMS_PER_SM programs per SM, whole BLOCK_K steps."""
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms, num_tiles), k // block_k))
    return triton.cdiv(k // block_k, splits) * block_k


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gelu: bool = False) -> torch.Tensor:
    """x [M, K] with M <= 16, weight [N, K] (F.linear layout) -> act(x @ weight.T + bias)."""
    (m, k), n = x.shape, weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert k % 16 == 0, "K must be a multiple of 16 (every GPT-2 width is)"
    block_k = next(b for b in (MAX_BLOCK_K, 64, 32, 16) if k % b == 0)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    num_tiles = triton.cdiv(n, BLOCK_N)
    k_per_split = _k_per_split(num_tiles, k, block_k, num_sms(x.device))
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    bias_arg = out if bias is None else bias
    _skinny_kernel[(num_tiles, splits)](
        x, weight, bias_arg, out, part, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, GELU=gelu, SPLIT=splits > 1, BLOCK_M=MAX_M,
        BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if splits > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, 256))](
            part, bias_arg, out, m, n, splits, out.stride(0), HAS_BIAS=bias is not None,
            GELU=gelu, BLOCK=256, num_warps=4)
    return out


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (F.gelu(y, approximate="tanh") if gelu else y).to(x.dtype)
