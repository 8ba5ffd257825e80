import pytest
import torch

from kernel_cases import DEVICE, DTYPES, INTERPRET, tol
from kernels.skinny_gemm import (AddNorm, TileConfig, skinny_add_norm_linear,
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


def test_skinny_gelu_epilogue_tails():
    """Pre-activations of +-30 and +-1e4 (exp2 overflow and underflow in gelu_tanh) come out
    finite and as the reference's: 0 below, z above."""
    k = 64
    weight = torch.zeros(4, k, device=DEVICE)
    bias = torch.tensor([-30.0, 30.0, -1e4, 1e4], device=DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    out = skinny_linear(x, weight, bias, True)
    torch.testing.assert_close(out, skinny_linear_reference(x, weight, bias, True))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("gelu", [False, True])
def test_skinny_add_norm_linear(dtype, n, k, m, gelu):
    _check_add_norm_linear(dtype, n, k, m, gelu, TileConfig())


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("m", [1, 7])
def test_skinny_small_tiles(block_n, m):
    """The narrower W tiles that shapes with few rows per SM take, plain and with the norm."""
    config = TileConfig(block_n=block_n, block_k=32, min_split_steps=1)
    x = torch.randn(m, 208, device=DEVICE).to(torch.float16)
    weight = (torch.randn(96, 208, device=DEVICE) / 208 ** 0.5).to(torch.float16)
    bias = torch.randn(96, device=DEVICE).to(torch.float16)
    torch.testing.assert_close(skinny_linear(x, weight, bias, True, config),
                               skinny_linear_reference(x, weight, bias, True),
                               **tol(torch.float16))
    _check_add_norm_linear(torch.float16, 96, 208, m, False, config)


def _check_add_norm_linear(dtype, n, k, m, gelu, config):
    """The new residual matches the unfused add exactly (one rounding of the same sum); the
    output matches the fp32 reference on that residual, since the kernel rounds only its
    output (the unfused path also rounds the normalised input). The residual's mean is 14
    standard deviations from zero, which the affine form must not cancel away."""
    x, residual = (torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2))
    residual += 20.0
    norm = AddNorm(residual, torch.randn(k, device=DEVICE).to(dtype),
                   torch.randn(k, device=DEVICE).to(dtype), 1e-5)
    weight = (torch.randn(n, k, device=DEVICE) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out, summed = skinny_add_norm_linear(x, norm, weight, bias, gelu, config)
    expected_sum = skinny_add_norm_linear_reference(x, norm, weight, bias, gelu)[1]
    fp32_norm = AddNorm(torch.zeros_like(summed, dtype=torch.float32), norm.weight.float(),
                        norm.bias.float(), norm.eps)
    expected = skinny_add_norm_linear_reference(summed.float(), fp32_norm, weight.float(),
                                                bias.float(), gelu)[0].to(dtype)
    if INTERPRET and dtype == torch.bfloat16:
        # the interpreter's fp32 -> bf16 casts truncate instead of rounding to nearest: s may
        # differ by an ulp, and gamma * d is biased by up to one, which can add up to two
        # output ulps; on a GPU tol() holds and s is exact
        torch.testing.assert_close(summed, expected_sum, **tol(dtype))
        torch.testing.assert_close(out, expected, atol=6e-2, rtol=1e-2)
    else:
        assert torch.equal(summed, expected_sum)
        torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize("config", [TileConfig(), TileConfig(block_k=16, min_split_steps=1)])
def test_skinny_norm_statistics_far_from_zero(config):
    """fp32 rows with mean 1000 and standard deviation 1: the row statistics must not lose
    the variance to cancellation (sums of s^2 ~ 1e6 per element)."""
    x = torch.randn(3, 640, device=DEVICE)
    residual = torch.full_like(x, 1000.0)
    norm = AddNorm(residual, torch.ones(640, device=DEVICE), torch.zeros(640, device=DEVICE), 1e-5)
    weight = torch.randn(64, 640, device=DEVICE) / 640 ** 0.5
    out, _ = skinny_add_norm_linear(x, norm, weight, None, False, config)
    expected, _ = skinny_add_norm_linear_reference(x, norm, weight, None, False)
    torch.testing.assert_close(out, expected, **tol(torch.float32))
