"""The linear dispatch gives the reference result on either path, and takes the skinny GEMM
exactly for the shapes its measured table names."""
import pytest
import torch

from engine.layers import linear as linear_reference
from kernel_cases import DEVICE, tol
from kernels import skinny_gemm
from kernels.linear import LinearDispatch


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_both_paths_match_reference(m, gelu, monkeypatch):
    n, k = 96, 64
    x = torch.randn(m, k, device=DEVICE)
    weight, bias = torch.randn(n, k, device=DEVICE) / 8, torch.randn(n, device=DEVICE)
    calls = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr("kernels.linear.skinny_linear",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    expected = linear_reference(x, weight, bias, gelu)
    for wins in (frozenset(), frozenset({(n, k, m, gelu)} if m <= 16 else set())):
        calls.clear()
        out = LinearDispatch(wins)(x, weight, bias, gelu)
        torch.testing.assert_close(out, expected, **tol(torch.float32))
        assert len(calls) == (1 if wins else 0)
