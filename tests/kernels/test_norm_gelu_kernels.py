import pytest
import torch

from engine.worker.layers import TORCH_OPS
from kernel_cases import DEVICE, DTYPES, INTERPRET, tol
from engine.worker.triton_ops import triton_ops

LN_SHAPES = [(1, 768), (5, 1600), (2, 3, 100), (1027, 48)]  # the last: 4 rows per program
if not INTERPRET:
    LN_SHAPES += [(4096, 1600), (333, 1280)]


def _ln_params(n, dtype):
    weight = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    return weight, (0.1 * torch.randn(n, device=DEVICE)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layer_norm(dtype, shape):
    x = (3 * torch.randn(shape, device=DEVICE) + 1).to(dtype)
    weight, bias = _ln_params(shape[-1], dtype)
    out = triton_ops().layer_norm(x, weight, bias, 1e-5)
    torch.testing.assert_close(out, TORCH_OPS.layer_norm(x, weight, bias, 1e-5), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_add_layer_norm(dtype, shape):
    x, residual = (torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2))
    weight, bias = _ln_params(shape[-1], dtype)
    normed, summed = triton_ops().add_layer_norm(x, residual, weight, bias, 1e-5)
    ref_normed, ref_summed = TORCH_OPS.add_layer_norm(x, residual, weight, bias, 1e-5)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter's fp32->bf16 cast truncates
        torch.testing.assert_close(summed, ref_summed, **tol(dtype))
        ref_normed = TORCH_OPS.layer_norm(summed, weight, bias, 1e-5)  # of the kernel's sum
    else:
        assert torch.equal(summed, ref_summed)  # one rounded add either way
    torch.testing.assert_close(normed, ref_normed, **tol(dtype))
