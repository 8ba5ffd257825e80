"""The linear dispatch gives the reference result on either path, and takes the skinny GEMM
exactly for the shapes its measured table names."""
import pytest
import torch

from engine.worker.layers import add_norm_linear as add_norm_linear_reference
from engine.worker.layers import linear as linear_reference
import kernels.linear as linear_module
from kernel_cases import DEVICE, tol
from kernels.linear import LinearDispatch
from kernels.skinny_gemm import TileConfig


def _count_skinny_launches(monkeypatch) -> list:
    calls = []
    for name in ("skinny_linear", "skinny_add_norm_linear"):
        real = getattr(linear_module, name)
        monkeypatch.setattr(linear_module, name,
                            lambda *a, real=real, name=name, **kw: calls.append(name)
                            or real(*a, **kw))
    return calls


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_both_paths_match_reference(m, gelu, monkeypatch):
    n, k = 96, 64
    x = torch.randn(m, k, device=DEVICE)
    weight, bias = torch.randn(n, k, device=DEVICE) / 8, torch.randn(n, device=DEVICE)
    calls = _count_skinny_launches(monkeypatch)
    expected = linear_reference(x, weight, bias, gelu)
    for wins in ({}, {(n, k, m, gelu, False): TileConfig()} if m <= 16 else {}):
        calls.clear()
        out = LinearDispatch(wins)(x, weight, bias, gelu)
        torch.testing.assert_close(out, expected, **tol(torch.float32))
        assert len(calls) == (1 if wins else 0)


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("m", [1, 16, 40])
def test_add_norm_linear_paths_match_reference(m, gelu, monkeypatch):
    """Only a win recorded with the norm takes the fused kernel; one recorded without it
    takes the add + LayerNorm kernel, then the plain skinny GEMM."""
    n, k = 96, 64
    x, residual = torch.randn(m, k, device=DEVICE), torch.randn(m, k, device=DEVICE)
    ln_w, ln_b = torch.randn(k, device=DEVICE), torch.randn(k, device=DEVICE)
    weight, bias = torch.randn(n, k, device=DEVICE) / 8, torch.randn(n, device=DEVICE)
    calls = _count_skinny_launches(monkeypatch)
    expected = add_norm_linear_reference(x, residual, ln_w, ln_b, 1e-5, weight, bias, gelu)
    for norm_flag in (False, True):
        calls.clear()
        wins = {(n, k, m, gelu, norm_flag): TileConfig()} if m <= 16 else {}
        out = LinearDispatch(wins).add_norm_linear(x, residual, ln_w, ln_b, 1e-5, weight, bias,
                                                   gelu)
        torch.testing.assert_close(out, expected, **tol(torch.float32))
        fused = ["skinny_add_norm_linear"] if norm_flag else ["skinny_linear"]
        assert calls == (fused if wins else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times inside CUDA graphs")
def test_measured_table_names_candidate_configs_only():
    """The timing after the parallel compile: every win is a candidate at a measured shape."""
    from kernels.linear import measure_skinny_wins
    from kernels.skinny_gemm import TILE_CANDIDATES

    shapes, sizes = [(768, 768, False, False), (3072, 768, True, True)], [1, 4, 32]
    wins = measure_skinny_wins(shapes, sizes, torch.float16, torch.device(DEVICE))
    assert all(config in TILE_CANDIDATES for config in wins.values())
    assert {key[2] for key in wins} <= {1, 4}  # 32 > MAX_M: never skinny
