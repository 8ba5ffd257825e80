"""Linear layers on the GPU path: cuBLAS (F.linear) or the skinny weight-streaming GEMM, chosen
per (N, K, M, gelu, norm), with its tile config, by a table measured on the running GPU at
startup. The skinny kernel fuses bias and GELU, and for the pre-norm linears (QKV, FC) the
residual add and LayerNorm, into one launch. An 8-bit weight (the engine's QuantizedWeight:
`data` int8 or float8_e4m3fn [N, K], `scale` float32 [N]) takes kernels/quant_linear.py at
every M, fused the same way. References: `engine.worker.layers.linear` and
`engine.worker.layers.add_norm_linear`.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from kernels.gelu import bias_gelu
from kernels.layernorm import add_layer_norm
from kernels.quant_linear import quant_add_norm_linear, quant_linear
from kernels.skinny_gemm import (MAX_M, TILE_CANDIDATES, AddNorm, TileConfig, compile_skinny,
                                 skinny_add_norm_linear, skinny_linear)
from kernels.timing import cuda_ms

log = logging.getLogger(__name__)
ShapeKey = tuple[int, int, int, bool, bool]  # (N, K, M, gelu, norm fused in)
SkinnyWins = Mapping[ShapeKey, TileConfig]


class LinearDispatch:
    """Callable as `linear(x, weight, bias, gelu=False)`, with `add_norm_linear` beside it;
    `skinny_wins`: shape -> the skinny tile config that beat cuBLAS (empty: never). A weight
    that is not a tensor is 8-bit (module doc)."""

    def __init__(self, skinny_wins: SkinnyWins | None = None):
        self.skinny_wins = skinny_wins or {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 gelu: bool = False) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):
            return quant_linear(x, weight.data, weight.scale, bias, gelu)
        config = self.skinny_wins.get((weight.shape[0], weight.shape[1], x.shape[0], gelu, False))
        if config is not None:
            return skinny_linear(x, weight, bias, gelu, config)
        return bias_gelu(F.linear(x, weight), bias) if gelu else F.linear(x, weight, bias)

    def add_norm_linear(self, x: torch.Tensor, residual: torch.Tensor,
                        norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(LayerNorm(x + residual)), x + residual): one skinny launch for the shapes
        it won, else the add + LayerNorm kernel and then the linear."""
        if not isinstance(weight, torch.Tensor):
            return quant_add_norm_linear(x, AddNorm(residual, norm_weight, norm_bias, eps),
                                         weight.data, weight.scale, bias, gelu)
        config = self.skinny_wins.get((weight.shape[0], weight.shape[1], x.shape[0], gelu, True))
        if config is not None:
            norm = AddNorm(residual, norm_weight, norm_bias, eps)
            return skinny_add_norm_linear(x, norm, weight, bias, gelu, config)
        normed, summed = add_layer_norm(x, residual, norm_weight, norm_bias, eps)
        return self(normed, weight, bias, gelu), summed


def measure_skinny_wins(shapes: list[tuple[int, int, bool, bool]], batch_sizes: list[int],
                        dtype: torch.dtype, device: torch.device) -> dict[ShapeKey, TileConfig]:
    """For each (N, K, gelu, norm) and M <= MAX_M, time each candidate tile config against
    the unfused path inside CUDA graphs (as a captured decode step), weights rotated so they
    stream from memory as in a real step."""
    compile_candidates(shapes, batch_sizes, dtype, device)
    wins = {}
    for n, k, gelu, norm in shapes:
        weights = [torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
                   for _ in range(max(2, (256 << 20) // (n * k * dtype.itemsize)))][:16]
        bias = torch.randn(n, dtype=dtype, device=device)
        ln_w, ln_b = (torch.randn(k, dtype=dtype, device=device) for _ in range(2))
        for m in (m for m in batch_sizes if m <= MAX_M):
            x, residual = (torch.randn(m, k, dtype=dtype, device=device) for _ in range(2))
            key = (n, k, m, gelu, norm)
            paths = {None: LinearDispatch(),
                     **{c: LinearDispatch({key: c}) for c in TILE_CANDIDATES}}
            times = {config: _graph_ms_if_fits(layer_call(dispatch, x, residual, ln_w, ln_b,
                                                          bias, norm, gelu), weights)
                     for config, dispatch in paths.items()}
            best = min(times, key=times.get)
            if best is not None:
                wins[key] = best
            log.info("linear N=%d K=%d M=%d gelu=%s norm=%s: unfused %.4f ms, skinny %s", n, k,
                     m, gelu, norm, times.pop(None),
                     ", ".join(f"{tuple(c)} {t:.4f}" for c, t in times.items()))
    return wins


def compile_candidates(shapes: list[tuple[int, int, bool, bool]], batch_sizes: list[int],
                       dtype: torch.dtype, device: torch.device,
                       candidates: tuple[TileConfig, ...] = TILE_CANDIDATES) -> None:
    """Compile every variant measure_skinny_wins times, up front in a thread pool (Triton
    compiles mostly outside the GIL). Needs triton.AsyncCompileMode with ignore_errors, else
    they compile one by one as timed; a variant failing here fails again, loudly, when timed."""
    if not shapes:
        return
    async_compile = getattr(triton, "AsyncCompileMode", None)
    if async_compile is None or "ignore_errors" not in inspect.signature(async_compile).parameters:
        log.info("this Triton has no AsyncCompileMode(ignore_errors): the skinny GEMM "
                 "variants compile one at a time as they are timed")
        return
    start, threads = time.perf_counter(), min(32, os.cpu_count() or 1)
    sizes = [m for m in batch_sizes if m <= MAX_M]
    with ThreadPoolExecutor(threads) as pool, async_compile(pool, ignore_errors=True):
        for n, k, gelu, norm in shapes:
            weight, bias, ln_w, ln_b = (torch.empty(shape, dtype=dtype, device=device)
                                        for shape in ((n, k), (n,), (k,), (k,)))
            for m in sizes:
                x, residual = (torch.empty(m, k, dtype=dtype, device=device) for _ in range(2))
                add_norm = AddNorm(residual, ln_w, ln_b, 1e-5) if norm else None
                for config in candidates:
                    compile_skinny(x, weight, bias, gelu, add_norm, config)
    log.info("compiled %d skinny GEMM variants (shape x batch size x tile config) in %.1f s "
             "on %d threads", len(shapes) * len(sizes) * len(candidates),
             time.perf_counter() - start, threads)


def _graph_ms_if_fits(call, weights: list[torch.Tensor]) -> float:
    """graph_ms, or infinity for a tile config whose shared memory exceeds this GPU's at this
    dtype (fp32 doubles the tiles of fp16, which the candidates were tuned for)."""
    try:
        return graph_ms(call, weights)
    except OutOfResources:
        return math.inf


def layer_call(dispatch: LinearDispatch, x, residual, ln_w, ln_b, bias, norm: bool, gelu: bool):
    """The layer as the model calls it, for a weight passed in."""
    if norm:
        return lambda w: dispatch.add_norm_linear(x, residual, ln_w, ln_b, 1e-5, w, bias, gelu)
    return lambda w: dispatch(x, w, bias, gelu)


def graph_ms(call, weights: list[torch.Tensor], replays: int = 10) -> float:
    for w in weights:
        call(w)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            call(w)
    graph.replay()
    return cuda_ms(graph.replay, replays) / len(weights)
