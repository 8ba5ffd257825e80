import pytest
import torch

from engine.worker.layers import TORCH_OPS
from engine.worker.layers import quantize_rows_fp8 as quantize_rows_fp8_reference
from kernel_cases import DEVICE, DTYPES, INTERPRET, tol
from engine.worker.triton_ops import triton_ops
from kernels.layernorm import add_layer_norm_fp8

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


def _assert_fp8_rows_match(q, scale, x_ref):
    """q, scale from a kernel against engine.worker.layers.quantize_rows_fp8(x_ref): the same
    scales, and codes that differ by at most one e4m3 step (a division's last bit at a tie)."""
    ref_q, ref_scale = quantize_rows_fp8_reference(x_ref)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (x_ref.shape[0], 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    step = ref_q.float().abs().clamp(min=2 ** -6) * 2 ** -3  # e4m3: 3 mantissa bits
    assert ((q.float() - ref_q.float()).abs() <= step).all()
    assert (q.float() == ref_q.float()).float().mean() > 0.99
    assert q.float().abs().amax(1).eq(448).all()  # each row's largest maps to e4m3's largest


FP8_ROW_SHAPES = [(17, 768), (3, 1600), (1029, 96), (2, 6400)]  # 1029: 4 rows per program


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", FP8_ROW_SHAPES)
def test_add_layer_norm_fp8_quantizes_the_normed_rows(dtype, shape):
    x, residual = (torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2))
    weight, bias = _ln_params(shape[-1], dtype)
    q, scale, summed = add_layer_norm_fp8(x, residual, weight, bias, 1e-5)
    ref_normed, ref_summed = TORCH_OPS.add_layer_norm(x, residual, weight, bias, 1e-5)
    torch.testing.assert_close(summed, ref_summed, **tol(dtype))
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter's fp32->bf16 cast truncates
        ref_normed = TORCH_OPS.layer_norm(summed, weight, bias, 1e-5)
    torch.testing.assert_close((q.float() * scale).to(dtype), ref_normed,
                               rtol=2 ** -3, atol=2 ** -9 * scale.max().item())
    if not (INTERPRET and dtype == torch.bfloat16):
        _assert_fp8_rows_match(q, scale, ref_normed)


def test_add_layer_norm_fp8_keeps_a_row_of_zeros_zero():
    """A constant row normalises to zeros (bias 0): a finite scale, and its codes stay 0."""
    x = torch.zeros(2, 64, dtype=torch.float16, device=DEVICE)
    x[1, 3] = -2.0
    weight = torch.ones(64, dtype=torch.float16, device=DEVICE)
    bias = torch.zeros(64, dtype=torch.float16, device=DEVICE)
    q, scale, _ = add_layer_norm_fp8(x, torch.zeros_like(x), weight, bias, 1e-5)
    assert torch.equal(q[0].float(), torch.zeros(64, device=DEVICE))
    assert q[1, 3].float() == -448 and torch.isfinite(scale).all()


def test_the_kernels_fp8_constants_are_the_references():
    """kernels/ imports nothing from engine/, so the LayerNorm kernel keeps its own copies."""
    import kernels.layernorm as kernel
    import engine.worker.layers as reference
    assert kernel.FP8_MAX.value == reference.FP8_MAX
    assert kernel.FP8_MIN_AMAX.value == reference.FP8_MIN_AMAX
