import pytest
import torch

from kernel_cases import DEVICE, DTYPES, INTERPRET, tol
from kernels.skinny_gemm import (AddNorm, skinny_add_norm_linear,
                                 skinny_add_norm_linear_reference, skinny_linear,
                                 skinny_linear_reference)

# (N, K): split-K on few tiles, odd N / K not a multiple of 128, many tiles (no split)
SHAPES = [(96, 208), (130, 64), (640, 256)]
if not INTERPRET:
    SHAPES += [(2304, 768), (768, 3072), (6400, 1600), (1600, 6400)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("epilogue", ["none", "bias", "bias_gelu"])
def test_skinny_linear(dtype, n, k, m, epilogue):
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = None if epilogue == "none" else torch.randn(n, device=DEVICE).to(dtype)
    gelu = epilogue == "bias_gelu"
    out = skinny_linear(x, weight, bias, gelu)
    torch.testing.assert_close(out, skinny_linear_reference(x, weight, bias, gelu), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("gelu", [False, True])
def test_skinny_add_norm_linear(dtype, n, k, m, gelu):
    """The residual add and LayerNorm in the prologue: output and new residual both match the
    unfused reference (the residual exactly: one rounding of the same sum)."""
    x, residual = (torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2))
    residual += 3.0  # a mean far from zero, as GPT-2's residual stream has
    norm = AddNorm(residual, torch.randn(k, device=DEVICE).to(dtype),
                   torch.randn(k, device=DEVICE).to(dtype), 1e-5)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out, summed = skinny_add_norm_linear(x, norm, weight, bias, gelu)
    expected, expected_sum = skinny_add_norm_linear_reference(x, norm, weight, bias, gelu)
    if INTERPRET and dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 casts are not round-to-nearest, so the normalised
        # GEMM input is off by up to a bf16 ulp (2^-8) per element; on a GPU tol() holds
        torch.testing.assert_close(out, expected, atol=6e-2, rtol=1e-2)
        torch.testing.assert_close(summed, expected_sum, **tol(dtype))
    else:
        torch.testing.assert_close(out, expected, **tol(dtype))
        assert torch.equal(summed, expected_sum)
