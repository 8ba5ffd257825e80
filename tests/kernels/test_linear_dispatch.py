"""The linear dispatch gives the reference result on every path, and takes the skinny GEMM or
the GEMV exactly for the shapes its measured table names."""
import pytest
import torch

from engine.worker.layers import add_norm_linear as add_norm_linear_reference
from engine.worker.layers import linear as linear_reference
import kernels.linear as linear_module
from kernel_cases import DEVICE, tol
from engine.worker.quantization import quantize_weight
from kernels.gemv import GemvConfig
from kernels.linear import LinearDispatch
from kernels.skinny_gemm import TileConfig


def _count_skinny_launches(monkeypatch, names=("skinny_linear", "skinny_add_norm_linear")
                           ) -> list:
    calls = []
    for name in names:
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


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("norm_flag", [False, True])
def test_a_gemv_win_takes_the_gemv(quantization, norm_flag, monkeypatch):
    """A GemvConfig in the table sends that shape, 16-bit or 8-bit, to the GEMV, and only
    that shape (another M takes the default path)."""
    n, k = 96, 64
    ln_w, ln_b = torch.randn(k, device=DEVICE), torch.randn(k, device=DEVICE)
    weight, bias = torch.randn(n, k, device=DEVICE) / 8, torch.randn(n, device=DEVICE)
    if quantization:
        weight = quantize_weight(weight, quantization)
    calls = _count_skinny_launches(monkeypatch, ("gemv_linear", "gemv_add_norm_linear"))
    dispatch = LinearDispatch({(n, k, 1, True, norm_flag): GemvConfig(8, 32, 2, 1, True, 2)})
    for m in (1, 2):
        calls.clear()
        x, residual = torch.randn(m, k, device=DEVICE), torch.randn(m, k, device=DEVICE)
        if norm_flag:
            out = dispatch.add_norm_linear(x, residual, ln_w, ln_b, 1e-5, weight, bias, True)
            expected = add_norm_linear_reference(x, residual, ln_w, ln_b, 1e-5, weight, bias,
                                                 True)
        else:
            out, expected = dispatch(x, weight, bias, True), linear_reference(x, weight, bias,
                                                                              True)
        torch.testing.assert_close(out, expected, **tol(torch.float32))
        name = "gemv_add_norm_linear" if norm_flag else "gemv_linear"
        assert calls == ([name] if m == 1 else [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times inside CUDA graphs")
@pytest.mark.parametrize("weight_dtype", [None, torch.int8])
def test_measured_table_names_candidate_configs_only(weight_dtype):
    """The timing after the parallel compile: every win is a candidate at a measured shape;
    8-bit weights try the GEMV only."""
    from kernels.linear import GEMV_CANDIDATES, GEMV_CANDIDATES_8BIT, measure_linear_wins
    from kernels.skinny_gemm import TILE_CANDIDATES

    shapes, sizes = [(768, 768, False, False), (3072, 768, True, True)], [1, 2, 4, 32]
    wins = measure_linear_wins(shapes, sizes, torch.float16, torch.device(DEVICE),
                               weight_dtype)
    allowed = (GEMV_CANDIDATES + TILE_CANDIDATES if weight_dtype is None
               else GEMV_CANDIDATES_8BIT)
    assert all(config in allowed for config in wins.values())
    assert {key[2] for key in wins} <= ({1, 2, 4} if weight_dtype is None else {1, 2})
    assert not any(isinstance(config, GemvConfig) for key, config in wins.items()
                   if key[2] > 2)
