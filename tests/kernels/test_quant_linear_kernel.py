"""The 8-bit weight-only linear kernel against its reference, int8 and fp8, on every path: one
x tile with split-K, several M tiles, the fused add + LayerNorm, and (CUDA) a captured graph."""
import pytest
import torch

from engine.worker.layers import FP8_GEMM_MIN_ROWS, uses_fp8_gemm
from engine.worker.layers import add_norm_linear as add_norm_linear_reference
from engine.worker.layers import linear as linear_reference
from engine.worker.quantization import quantize_weight
from kernel_cases import DEVICE, DTYPES, INTERPRET, replayed_on_new_inputs, tol
from kernels.quant_linear import (MAX_TILE_M, quant_add_norm_linear,
                                  quant_add_norm_linear_reference, quant_linear,
                                  quant_linear_reference)
from kernels.linear import DEQUANT_MIN_ROWS, LinearDispatch
from kernels.skinny_gemm import MAX_M, AddNorm, TileConfig

METHODS = ["int8", "fp8"]
# (N, K): split-K on few tiles with K not a multiple of 32; more tiles, shorter K
SHAPES = [(96, 208), (130, 64)]
# one x tile (1, 16 rows; 40: past the skinny GEMM's 16), and 2 M tiles of 128 (130)
BATCHES = [1, 16, 40, 130]
if not INTERPRET:
    SHAPES += [(2304, 768), (768, 3072), (6400, 1600), (1600, 6400)]
    BATCHES += [5, 64, 256]


def _weight(n: int, k: int, method: str):
    return quantize_weight(torch.randn(n, k, device=DEVICE) / k ** 0.5, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", BATCHES)
def test_quant_linear_bias_gelu(method, dtype, n, k, m):
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = _weight(n, k, method)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = quant_linear(x, weight.data, weight.scale, bias, True)
    expected = quant_linear_reference(x, weight.data, weight.scale, bias, True)
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m", [3, 130])
def test_quant_linear_without_bias(method, m):
    x = torch.randn(m, 208, device=DEVICE).to(torch.float16)
    weight = _weight(96, 208, method)
    out = quant_linear(x, weight.data, weight.scale)
    torch.testing.assert_close(out, quant_linear_reference(x, weight.data, weight.scale),
                               **tol(torch.float16))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, MAX_M, MAX_TILE_M])
@pytest.mark.parametrize("gelu", [False, True])
def test_quant_add_norm_linear(method, dtype, m, gelu):
    """Fused up to MAX_M rows, the add + LayerNorm kernel first beyond. The new
    residual matches the unfused add (exactly where fused: one rounding of the same sum);
    the output matches the fp32 reference on that residual, as the skinny GEMM's test says
    why. The residual's mean sits 20 standard deviations from zero."""
    k, n = 208, 96
    x, residual = (torch.randn(m, k, device=DEVICE).to(dtype) for _ in range(2))
    residual += 20.0
    norm = AddNorm(residual, torch.randn(k, device=DEVICE).to(dtype),
                   torch.randn(k, device=DEVICE).to(dtype), 1e-5)
    weight = _weight(n, k, method)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out, summed = quant_add_norm_linear(x, norm, weight.data, weight.scale, bias, gelu)
    expected_sum = quant_add_norm_linear_reference(x, norm, weight.data, weight.scale, bias,
                                                   gelu)[1]
    fp32_norm = AddNorm(torch.zeros_like(summed, dtype=torch.float32), norm.weight.float(),
                        norm.bias.float(), norm.eps)
    expected = quant_add_norm_linear_reference(summed.float(), fp32_norm, weight.data,
                                               weight.scale, bias.float(), gelu)[0].to(dtype)
    if dtype == torch.float32 or m <= MAX_M:
        torch.testing.assert_close(out, expected, **_norm_tol(dtype))
    else:  # the unfused path rounds the normalised input to dtype first
        torch.testing.assert_close(out, expected, atol=5e-2, rtol=2e-2)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        torch.testing.assert_close(summed, expected_sum, **tol(dtype))
    else:
        assert torch.equal(summed, expected_sum)


def _norm_tol(dtype: torch.dtype) -> dict:
    """tol(), but the interpreter's truncating bf16 casts bias gamma * d (skinny GEMM test)."""
    return dict(atol=6e-2, rtol=1e-2) if INTERPRET and dtype == torch.bfloat16 else tol(dtype)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("config", [TileConfig(16, 32, 2, 2, 1), TileConfig(32, 16, 4, 3, 1)])
def test_quant_small_tiles_split_k(method, config):
    """Narrow W tiles and short K steps: many splits, plain and with the fused norm."""
    k, n, m = 208, 96, 7
    x, residual = (torch.randn(m, k, device=DEVICE).to(torch.float16) for _ in range(2))
    weight = _weight(n, k, method)
    bias = torch.randn(n, device=DEVICE).to(torch.float16)
    torch.testing.assert_close(quant_linear(x, weight.data, weight.scale, bias, True, config),
                               quant_linear_reference(x, weight.data, weight.scale, bias, True),
                               **tol(torch.float16))
    norm = AddNorm(residual, torch.ones(k, device=DEVICE).to(torch.float16),
                   torch.zeros(k, device=DEVICE).to(torch.float16), 1e-5)
    out, summed = quant_add_norm_linear(x, norm, weight.data, weight.scale, bias, False, config)
    fp32_norm = AddNorm(torch.zeros_like(summed, dtype=torch.float32), norm.weight.float(),
                        norm.bias.float(), 1e-5)
    expected = quant_add_norm_linear_reference(summed.float(), fp32_norm, weight.data,
                                               weight.scale, bias.float())[0]
    torch.testing.assert_close(out, expected.half(), **tol(torch.float16))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m", sorted({1, FP8_GEMM_MIN_ROWS - 1, FP8_GEMM_MIN_ROWS,
                                      DEQUANT_MIN_ROWS - 1, DEQUANT_MIN_ROWS, 130}))
def test_dispatch_serves_a_quantized_weight_like_the_engine_reference(method, m):
    """The engine's QuantizedWeight through LinearDispatch (the Triton backend's linears)
    against engine.worker.layers' reference, which dequantizes (and from FP8_GEMM_MIN_ROWS
    rows on quantizes an fp8 weight's normed activations: the fp8 GEMM's numbers, which the
    weight-only kernel misses by ~1 %); a skinny tile config in the table does not apply.
    From DEQUANT_MIN_ROWS rows a plain linear's weight is dequantized as the reference does
    it, so on the CPU the two are the same ops: equal bit for bit without a bias."""
    k, n = 208, 96
    x, residual = (torch.randn(m, k, device=DEVICE) for _ in range(2))
    ln_w, ln_b, bias = (torch.randn(d, device=DEVICE) for d in (k, k, n))
    weight = _weight(n, k, method)
    dispatch = LinearDispatch({(n, k, m, True, norm): TileConfig() for norm in (False, True)},
                              uses_fp8_gemm)
    # Hopper's fp8 MMAs sum in less than fp32's precision: ~1e-4 relative on an H100
    close = ({"atol": 2e-3, "rtol": 2e-3} if method == "fp8" and m >= FP8_GEMM_MIN_ROWS
             and not INTERPRET else tol(torch.float32))
    torch.testing.assert_close(dispatch(x, weight, bias, True),
                               linear_reference(x, weight, bias, True), **close)
    torch.testing.assert_close(dispatch(x, weight, None), linear_reference(x, weight, None),
                               **close)
    out, summed = dispatch.add_norm_linear(x, residual, ln_w, ln_b, 1e-5, weight, bias, True)
    expected, expected_sum = add_norm_linear_reference(x, residual, ln_w, ln_b, 1e-5, weight,
                                                       bias, True)
    torch.testing.assert_close(out, expected, **close)
    torch.testing.assert_close(summed, expected_sum, **tol(torch.float32))
    if m >= DEQUANT_MIN_ROWS and DEVICE == "cpu":
        assert torch.equal(dispatch(x, weight, None), linear_reference(x, weight, None))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m", [1, 8, 48, 200])
def test_quant_linears_replay_in_a_cuda_graph(method, m):
    """Captured (after one eager run) and replayed on new inputs in place: no host sync and
    no allocation break the capture, and the split reductions' counters come back to zero."""
    k, n = 1600, 6400
    x, residual = (torch.randn(m, k, device=DEVICE, dtype=torch.float16) for _ in range(2))
    norm = AddNorm(residual, torch.randn(k, device=DEVICE, dtype=torch.float16),
                   torch.randn(k, device=DEVICE, dtype=torch.float16), 1e-5)
    fc, proj = _weight(n, k, method), _weight(k, n, method)
    fc_bias, proj_bias = (torch.randn(d, device=DEVICE, dtype=torch.float16) for d in (n, k))

    def layer():
        hidden, summed = quant_add_norm_linear(x, norm, fc.data, fc.scale, fc_bias, True)
        return quant_linear(hidden, proj.data, proj.scale, proj_bias), summed

    out, summed = replayed_on_new_inputs(layer, [x, residual])
    hidden, expected_sum = quant_add_norm_linear_reference(x, norm, fc.data, fc.scale, fc_bias,
                                                           True)
    expected = quant_linear_reference(hidden, proj.data, proj.scale, proj_bias)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", sorted({FP8_GEMM_MIN_ROWS, DEQUANT_MIN_ROWS, 200}))
def test_gemm_route_mlp_replays_in_a_cuda_graph_like_the_reference(method, dtype, m):
    """An MLP of 8-bit weights through LinearDispatch at rows that take a tensor-core GEMM
    (fp8: the add + LayerNorm quantizing, cuBLASLt's fp8 GEMM, GELU, then the projection's
    weight dequantized for cuBLAS; int8: both weights dequantized for cuBLAS), captured and
    replayed on new inputs, against engine.worker.layers' reference ops."""
    k, n = 1600, 6400
    x, residual = (torch.randn(m, k, device=DEVICE, dtype=dtype) for _ in range(2))
    ln_w, ln_b = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype), \
        (0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    fc, proj = _weight(n, k, method), _weight(k, n, method)
    fc_bias, proj_bias = (torch.randn(d, device=DEVICE, dtype=dtype) for d in (n, k))
    dispatch = LinearDispatch(None, uses_fp8_gemm)

    def mlp(ops_linear, ops_add_norm_linear):
        hidden, summed = ops_add_norm_linear(x, residual, ln_w, ln_b, 1e-5, fc, fc_bias, True)
        return ops_linear(hidden, proj, proj_bias), summed

    out, summed = replayed_on_new_inputs(lambda: mlp(dispatch, dispatch.add_norm_linear),
                                         [x, residual])
    expected, expected_sum = mlp(linear_reference, add_norm_linear_reference)
    assert torch.equal(summed, expected_sum)
    if method == "int8":  # the same dequantized weights; GELU in cuBLASLt's epilogue or
        # after, so a hidden value one bf16 step apart (outputs ~1-4: a step is up to 0.03)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)
        return
    # the FC's fp8 MMAs sum in less than fp32's precision: a hidden value one bf16 step apart
    # moves an output by up to ~0.1 (when the projection took e4m3 inputs too, 200 rows: 2 of
    # 320k elements past 0.05 on an H100)
    torch.testing.assert_close(out, expected, atol=1e-1, rtol=5e-2)
    weight_only = quant_linear(quant_add_norm_linear_reference(
        x, AddNorm(residual, ln_w, ln_b, 1e-5), fc.data, fc.scale, fc_bias, True)[0],
        proj.data, proj.scale, proj_bias)
    assert not torch.allclose(out, weight_only, atol=1e-3, rtol=1e-3)  # x was quantized too
