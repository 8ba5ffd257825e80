"""Bias add + tanh-approximate GELU (GPT-2's MLP activation) in one elementwise pass.

gelu_tanh(z) = 0.5 z (1 + tanh(u)) with u = sqrt(2/pi) (z + 0.044715 z^3). Since
0.5 (1 + tanh(u)) = sigmoid(2u), the kernel computes z / (1 + exp(-2u)) with exp2, which is
stable at both tails (huge exp -> result 0; exp underflows to 0 -> result z).
Elements are walked flat (bias column: offset % n_cols). Reference:
`engine.worker.layers.bias_gelu`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def gelu_tanh(z):
    """GELU(tanh) of fp32 z; shared with the skinny GEMM epilogue."""
    u = 0.7978845608028654 * (z + 0.044715 * z * z * z)  # sqrt(2/pi) (z + 0.044715 z^3)
    # exp(-2u) = 2^(-2 log2(e) u); capped below fp32 overflow, where z / 2^126 is 0 anyway
    return z / (1.0 + tl.exp2(tl.minimum(-2.8853900817779268 * u, 126.0)))


@triton.jit
def _bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, numel, n_cols, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(bias_ptr + offs % n_cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, gelu_tanh(z).to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    block = 2048
    if x.numel() > 0:
        _bias_gelu_kernel[(triton.cdiv(x.numel(), block),)](
            x, bias, out, x.numel(), x.shape[-1], BLOCK=block, num_warps=8,
            **pdl_options(x.device))
    return out
