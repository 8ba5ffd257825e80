"""Linear layers on the GPU path: cuBLAS (F.linear) or the skinny weight-streaming GEMM, chosen
per (N, K, M, gelu) by a table measured on the running GPU at startup, never by guess.

At decode batch sizes a linear layer is a pass over its weights, where cuBLAS leaves much of
the copy bandwidth unused; the skinny kernel also fuses bias and GELU into one launch.
Reference: `engine.layers.linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.gelu import bias_gelu
from kernels.skinny_gemm import MAX_M, skinny_linear

log = logging.getLogger(__name__)
ShapeKey = tuple[int, int, int, bool]  # (N, K, M, gelu)


class LinearDispatch:
    """Callable as `linear(x, weight, bias, gelu=False)`; `skinny_wins` holds the shapes
    where the skinny kernel measured faster (empty: always cuBLAS)."""

    def __init__(self, skinny_wins: frozenset[ShapeKey] = frozenset()):
        self.skinny_wins = skinny_wins

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 gelu: bool = False) -> torch.Tensor:
        if (weight.shape[0], weight.shape[1], x.shape[0], gelu) in self.skinny_wins:
            return skinny_linear(x, weight, bias, gelu)
        return bias_gelu(F.linear(x, weight), bias) if gelu else F.linear(x, weight, bias)


def measure_skinny_wins(shapes: list[tuple[int, int, bool]], batch_sizes: list[int],
                        dtype: torch.dtype, device: torch.device) -> frozenset[ShapeKey]:
    """Time both implementations inside CUDA graphs (launch overhead excluded, as in a
    captured decode step), weights rotated so they stream from memory as in a real step."""
    cublas = LinearDispatch()
    wins = set()
    for n, k, gelu in shapes:
        weights = [torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
                   for _ in range(max(2, (256 << 20) // (n * k * dtype.itemsize)))][:16]
        bias = torch.randn(n, dtype=dtype, device=device)
        for m in (m for m in batch_sizes if m <= MAX_M):
            x = torch.randn(m, k, dtype=dtype, device=device)
            skinny_ms = _graph_ms(lambda w: skinny_linear(x, w, bias, gelu), weights)
            cublas_ms = _graph_ms(lambda w: cublas(x, w, bias, gelu), weights)
            if skinny_ms < cublas_ms:
                wins.add((n, k, m, gelu))
            log.info("linear N=%d K=%d M=%d gelu=%s: skinny %.4f ms, cuBLAS %.4f ms", n, k, m,
                     gelu, skinny_ms, cublas_ms)
    return frozenset(wins)


def _graph_ms(call, weights: list[torch.Tensor], replays: int = 10) -> float:
    for w in weights:
        call(w)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * len(weights))
