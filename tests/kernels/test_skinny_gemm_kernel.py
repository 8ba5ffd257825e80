import pytest
import torch

from kernel_cases import DEVICE, DTYPES, INTERPRET, tol
from kernels.skinny_gemm import skinny_linear, skinny_linear_reference

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
