"""Tanh-approximate GELU (GPT-2's MLP activation) for the linear kernels' epilogues
(kernels/skinny_gemm.py, and through it the GEMV's and the 8-bit kernels'). cuBLAS linears
take it from cuBLASLt's bias + GELU epilogue instead (kernels/linear.py).

gelu_tanh(z) = 0.5 z (1 + tanh(u)) with u = sqrt(2/pi) (z + 0.044715 z^3). Since
0.5 (1 + tanh(u)) = sigmoid(2u), it computes z / (1 + exp(-2u)) with exp2, which is stable at
both tails (huge exp -> result 0; exp underflows to 0 -> result z). Reference:
`engine.worker.layers.bias_gelu`.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gelu_tanh(z):
    """GELU(tanh) of fp32 z; shared with the skinny GEMM epilogue."""
    u = 0.7978845608028654 * (z + 0.044715 * z * z * z)  # sqrt(2/pi) (z + 0.044715 z^3)
    # exp(-2u) = 2^(-2 log2(e) u); capped below fp32 overflow, where z / 2^126 is 0 anyway
    return z / (1.0 + tl.exp2(tl.minimum(-2.8853900817779268 * u, 126.0)))
