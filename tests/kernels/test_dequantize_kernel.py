"""The dequantize kernel (kernels/dequantize.py) against QuantizedWeight.dequantize, the
reference the engine's CPU path runs: the same fp32 products, rounded once."""
import pytest
import torch

from engine.worker.quantization import quantize_weight
from kernel_cases import DEVICE, INTERPRET
from kernels.dequantize import dequantize

# K: a multiple of 512 and of 64 only (tile widths), and one of none (masked columns);
# N: not a multiple of any tile's rows
SHAPES = [(40, 1024), (24, 1600), (70, 200)]
if not INTERPRET:
    SHAPES += [(4800, 1600), (1600, 6400), (2304, 768)]


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_dequantize_matches_the_reference(method, dtype, n, k):
    weight = quantize_weight(torch.randn(n, k, device=DEVICE) / k ** 0.5, method)
    out = dequantize(weight.data, weight.scale, dtype)
    expected = weight.dequantize(dtype)
    assert out.dtype == dtype and out.shape == (n, k)
    if dtype == torch.bfloat16 and INTERPRET:  # the interpreter's bf16 cast may truncate
        torch.testing.assert_close(out, expected, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(out, expected)
