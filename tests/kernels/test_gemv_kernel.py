"""The CUDA-core GEMV against the skinny and 8-bit references: 16-bit and 8-bit weights, M = 1
and 2, split K and not, EARLY and not, the fused add + LayerNorm, and (CUDA) a captured graph."""
import pytest
import torch

from engine.worker.quantization import quantize_weight
from kernel_cases import DEVICE, DTYPES, INTERPRET, replayed_on_new_inputs, tol
from kernels.gemv import GemvConfig, gemv_add_norm_linear, gemv_linear
from kernels.linear import GEMV_CANDIDATES_8BIT
from kernels.quant_linear import quant_add_norm_linear_reference, quant_linear_reference
from kernels.skinny_gemm import (AddNorm, skinny_add_norm_linear_reference,
                                 skinny_linear_reference)

# (N, K): few tiles and K not a multiple of the K step (masked tail); more tiles
SHAPES = [(96, 208), (130, 64)]
if not INTERPRET:
    SHAPES += [(2304, 768), (6400, 1600), (1600, 6400)]
CONFIGS = [GemvConfig(), GemvConfig(16, 64, 4, 1, False, 4), GemvConfig(8, 32, 2, 2, True, 1),
           GEMV_CANDIDATES_8BIT[-1]]  # 4 rows, K steps wider than the interpreter's K
# every dtype on the default config, the others on fp16 (the interpreter's time is CI's)
CONFIG_DTYPES = [(CONFIGS[0], dtype) for dtype in DTYPES] + [(c, torch.float16)
                                                             for c in CONFIGS[1:]]


def _weights(n: int, k: int, method: str | None, dtype: torch.dtype):
    """(weight, scale, dequantized fp32 weight or None for 16-bit)."""
    w = torch.randn(n, k, device=DEVICE) / k ** 0.5
    if method is None:
        return w.to(dtype), None
    q = quantize_weight(w, method)
    return q.data, q.scale


def _reference(x, weight, scale, bias, gelu, norm=None):
    if scale is None:
        if norm is None:
            return skinny_linear_reference(x, weight, bias, gelu), None
        return skinny_add_norm_linear_reference(x, norm, weight, bias, gelu)
    if norm is None:
        return quant_linear_reference(x, weight, scale, bias, gelu), None
    return quant_add_norm_linear_reference(x, norm, weight, scale, bias, gelu)


@pytest.mark.parametrize("method", [None, "int8", "fp8"])
@pytest.mark.parametrize("config,dtype", CONFIG_DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_bias_gelu(method, dtype, n, k, m, config):
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight, scale = _weights(n, k, method, dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = gemv_linear(x, weight, scale, bias, True, config)
    torch.testing.assert_close(out, _reference(x, weight, scale, bias, True)[0], **tol(dtype))


@pytest.mark.parametrize("method", [None, "int8"])
def test_gemv_without_bias(method):
    x = torch.randn(1, 208, device=DEVICE).to(torch.float16)
    weight, scale = _weights(96, 208, method, torch.float16)
    torch.testing.assert_close(gemv_linear(x, weight, scale),
                               _reference(x, weight, scale, None, False)[0],
                               **tol(torch.float16))


@pytest.mark.parametrize("method", [None, "int8", "fp8"])
@pytest.mark.parametrize("config,dtype", CONFIG_DTYPES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("gelu", [False, True])
def test_gemv_add_norm_linear(method, config, dtype, m, gelu):
    """The new residual equals the unfused add exactly (one rounding of the same sum); the
    output matches the unfused reference, which normalises in fp32 and rounds the normalised
    input to dtype as the kernel does. The residual's mean sits 20 standard deviations from
    zero, so a one-pass variance would cancel."""
    k, n = 208, 96
    x, residual = (torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2))
    residual += 20.0
    norm = AddNorm(residual, torch.randn(k, device=DEVICE).to(dtype),
                   torch.randn(k, device=DEVICE).to(dtype), 1e-5)
    weight, scale = _weights(n, k, method, dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out, summed = gemv_add_norm_linear(x, norm, weight, scale, bias, gelu, config)
    expected, expected_sum = _reference(x, weight, scale, bias, gelu, norm)
    if INTERPRET and dtype == torch.bfloat16:
        # the interpreter truncates fp32 -> bf16, which biases every normalised element the
        # same way; the output is compared natively on CUDA
        torch.testing.assert_close(summed, expected_sum, **tol(dtype))
    else:
        assert torch.equal(summed, expected_sum)
        torch.testing.assert_close(out, expected, **(tol(dtype) if dtype == torch.float32
                                                    else dict(atol=3e-2, rtol=2e-2)))


def test_an_8bit_weight_without_its_scales_is_refused():
    weight, scale = _weights(96, 208, "int8", torch.float16)
    with pytest.raises(AssertionError, match="scales"):
        gemv_linear(torch.randn(1, 208, device=DEVICE).half(), weight)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
@pytest.mark.parametrize("method", [None, "int8"])
def test_gemv_replays_in_a_cuda_graph(method):
    """Captured (after one eager run) and replayed on new inputs in place: no host sync and
    no allocation break the capture, and the split reductions' counters come back to zero."""
    k, n = 1600, 6400
    x, residual = (torch.randn(1, k, device=DEVICE, dtype=torch.float16) for _ in range(2))
    norm = AddNorm(residual, torch.randn(k, device=DEVICE, dtype=torch.float16),
                   torch.randn(k, device=DEVICE, dtype=torch.float16), 1e-5)
    fc, proj = _weights(n, k, method, torch.float16), _weights(k, n, method, torch.float16)
    fc_bias, proj_bias = (torch.randn(d, device=DEVICE, dtype=torch.float16) for d in (n, k))

    def layer():
        hidden, summed = gemv_add_norm_linear(x, norm, *fc, fc_bias, True)
        return gemv_linear(hidden, *proj, proj_bias), summed

    out, summed = replayed_on_new_inputs(layer, [x, residual])
    hidden, expected_sum = _reference(x, *fc, fc_bias, True, norm)
    expected = _reference(hidden, *proj, proj_bias, False)[0]
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)
