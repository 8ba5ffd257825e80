"""compile_skinny compiles exactly the variant the launch would run (same arguments, grid
and options) without launching it: the parallel compile before the skinny-GEMM timing then
leaves the timing loop nothing to compile."""
import pytest
import torch

import kernels.skinny_gemm as skinny_gemm
from kernels.skinny_gemm import AddNorm, TileConfig, compile_skinny


class RecordingKernel:
    """Stands in for the Triton kernel: records warmups (compiles) and launches."""

    def __init__(self):
        self.calls = []

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, _signature(args), kwargs))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, _signature(args),
                                                          kwargs))


def _signature(args):
    """What Triton specializes a launch on: tensor shapes and dtypes, the other values."""
    return [(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_compile_skinny_compiles_the_launched_variant(monkeypatch, m, norm):
    kernel = RecordingKernel()
    monkeypatch.setattr(skinny_gemm, "_skinny_kernel", kernel)
    n, k, config = 96, 256, TileConfig(32, 128, 2, 4, 1)
    x, weight, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    add_norm = AddNorm(torch.randn(m, k), torch.randn(k), torch.randn(k), 1e-5) if norm else None
    compile_skinny(x, weight, bias, True, add_norm, config)
    if norm:
        skinny_gemm.skinny_add_norm_linear(x, add_norm, weight, bias, True, config)
    else:
        skinny_gemm.skinny_linear(x, weight, bias, True, config)
    (compiled, *rest), (launched, *launch_rest) = kernel.calls
    assert (compiled, launched) == ("compile", "launch")
    assert rest == launch_rest
