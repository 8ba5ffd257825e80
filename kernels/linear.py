"""Linear layers on the GPU path: cuBLAS (F.linear), the skinny weight-streaming GEMM or, for one
or two rows, the GEMV on the CUDA cores, chosen per (N, K, M, gelu, norm), with its config, by
a table measured on the running GPU at startup. The Triton kernels fuse bias and GELU, and for
the pre-norm linears (QKV, FC) the residual add and LayerNorm, into one launch. An 8-bit weight
(the engine's QuantizedWeight: `data` int8 or float8_e4m3fn [N, K], `scale` float32 [N]) takes
the GEMV where its table says, else kernels/quant_linear.py, fused the same way. From
DEQUANT_MIN_ROWS rows an 8-bit weight is dequantized to x's dtype and runs cuBLAS as a 16-bit
weight does, but an fp8 weight after the add + LayerNorm where the engine's rule says
(`uses_fp8_gemm`: from 65 rows) runs cuBLASLt's fp8 x fp8 GEMM (`torch._scaled_mm`, tensor
cores) over x quantized by rows in the LayerNorm kernel (kernels/layernorm.py), each row's and
channel's scale and the bias in its epilogue. References:
`engine.worker.layers.linear` and `engine.worker.layers.add_norm_linear`.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from kernels import gemv
from kernels.dequantize import dequantize
from kernels.gemv import GemvConfig, compile_gemv, gemv_add_norm_linear, gemv_linear
from kernels.layernorm import add_layer_norm, add_layer_norm_fp8
from kernels.quant_linear import (Weight8, quant_add_norm_linear, quant_linear,
                                  random_weight8)
from kernels.skinny_gemm import (MAX_M, TILE_CANDIDATES, AddNorm, TileConfig, compile_skinny,
                                 skinny_add_norm_linear, skinny_linear)
from kernels.timing import cuda_ms

log = logging.getLogger(__name__)
ShapeKey = tuple[int, int, int, bool, bool]  # (N, K, M, gelu, norm fused in)
LinearConfig = TileConfig | GemvConfig
LinearWins = Mapping[ShapeKey, LinearConfig]
# the GEMV configs the startup table tries at M <= gemv.MAX_M: on an H100, the three of ten
# (the leaders of a 116-config sweep at gpt2-xl's width) whose best per shape came within 1 %
# of the ten's best, over the four GPT-2 widths' linears at M = 1, fp16, int8 and fp8
GEMV_CANDIDATES = (GemvConfig(8, 512, 4, 1, True, 2), GemvConfig(8, 256, 4, 1, True, 2),
                   GemvConfig(8, 512, 4, 1, False, 4))
# and for 8-bit weights: 4 rows a program, 1024-wide K steps (a tile of the 16-bit configs'
# bytes), the best of 56 configs for gpt2-xl's int8 output and MLP projections at M = 1 on an
# H200 (3.23 / 7.81 us against the three's 4.65 / 8.74; gpt2's output projection 2.33 / 3.50)
GEMV_CANDIDATES_8BIT = (*GEMV_CANDIDATES, GemvConfig(4, 1024, 4, 1, True, 2))


def gemv_candidates(eight_bit: bool) -> tuple[GemvConfig, ...]:
    """The GEMV configs the startup table tries for 16-bit or 8-bit weights."""
    return GEMV_CANDIDATES_8BIT if eight_bit else GEMV_CANDIDATES


# From this many rows on, an 8-bit weight is dequantized to x's dtype (kernels/dequantize.py,
# into a temporary) and its linear runs on cuBLAS (but fp8's fp8 GEMM, above); fewer rows
# stream it 8-bit (kernels/quant_linear.py). 65: the streaming kernel's 17-64 row tile won up
# to 64 rows (gpt2-xl's four int8 linears: 59 against 63 us at 64), its GEMM tiles lost from
# 65 (66-371 against 65-257 us at 65-2048 rows; docs/quantization.md)
DEQUANT_MIN_ROWS = 65


class LinearDispatch:
    """Callable as `linear(x, weight, bias, gelu=False)`, with `add_norm_linear` beside it;
    `wins`: shape -> the config of the kernel that beat the default path (empty: never), a
    TileConfig (skinny GEMM, 16-bit weights) or a GemvConfig. The default is cuBLAS for a
    16-bit weight, kernels/quant_linear.py for an 8-bit one (a weight that is not a tensor),
    cuBLAS over the dequantized weight for an 8-bit one over `dequant_min_rows` rows or more
    (the reference ops dequantize at every row count), but the fp8 GEMM for an fp8 one after
    the add + LayerNorm where `uses_fp8_gemm(rows, weight)` (the engine's rule,
    engine.worker.layers.uses_fp8_gemm, which its reference ops follow too; None: never)."""

    def __init__(self, wins: LinearWins | None = None,
                 uses_fp8_gemm: Callable[[int, object], bool] | None = None,
                 dequant_min_rows: float = DEQUANT_MIN_ROWS):
        self.wins = wins or {}
        self.uses_fp8_gemm = uses_fp8_gemm
        self.dequant_min_rows = dequant_min_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 gelu: bool = False) -> torch.Tensor:
        config = self.wins.get((weight.shape[0], weight.shape[1], x.shape[0], gelu, False))
        if isinstance(config, GemvConfig):
            return gemv_linear(x, *_operands(weight), bias, gelu, config)
        if not isinstance(weight, torch.Tensor):
            if self._dequantizes(x):
                return _cublas_linear(x, _dequantized(weight, x.dtype), bias, gelu)
            return quant_linear(x, weight.data, weight.scale, bias, gelu)
        if config is not None:
            return skinny_linear(x, weight, bias, gelu, config)
        return _cublas_linear(x, weight, bias, gelu)

    def add_norm_linear(self, x: torch.Tensor, residual: torch.Tensor,
                        norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor, gelu: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(LayerNorm(x + residual)), x + residual): one launch for the shapes a fused
        kernel won and for 8-bit weights, else the add + LayerNorm kernel and then cuBLAS."""
        config = self.wins.get((weight.shape[0], weight.shape[1], x.shape[0], gelu, True))
        norm = AddNorm(residual, norm_weight, norm_bias, eps)
        if isinstance(config, GemvConfig):
            return gemv_add_norm_linear(x, norm, *_operands(weight), bias, gelu, config)
        if not isinstance(weight, torch.Tensor):
            if self._takes_fp8_gemm(x, weight):
                q, q_scale, summed = add_layer_norm_fp8(x, residual, norm_weight, norm_bias,
                                                        eps)
                return _fp8_gemm(q, q_scale, weight, bias, gelu, x.dtype), summed
            if not self._dequantizes(x):
                return quant_add_norm_linear(x, norm, weight.data, weight.scale, bias, gelu)
            normed, summed = add_layer_norm(x, residual, norm_weight, norm_bias, eps)
            return _cublas_linear(normed, _dequantized(weight, x.dtype), bias, gelu), summed
        if config is not None:
            return skinny_add_norm_linear(x, norm, weight, bias, gelu, config)
        normed, summed = add_layer_norm(x, residual, norm_weight, norm_bias, eps)
        return self(normed, weight, bias, gelu), summed

    def _takes_fp8_gemm(self, x: torch.Tensor, weight) -> bool:
        """An 8-bit `weight` over x's rows takes the fp8 GEMM: the engine's rule says so."""
        return self.uses_fp8_gemm is not None and self.uses_fp8_gemm(x.shape[0], weight)

    def _dequantizes(self, x: torch.Tensor) -> bool:
        """An 8-bit weight over x's rows is dequantized for cuBLAS (where no fp8 GEMM runs)."""
        return x.shape[0] >= self.dequant_min_rows


def _cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   gelu: bool) -> torch.Tensor:
    """x @ weight.T + bias for a 16-bit weight, then GELU(tanh) if asked: cuBLAS on CUDA."""
    if not gelu:
        return F.linear(x, weight, bias)
    if x.is_cuda:  # bias + tanh-GELU in cuBLASLt's epilogue: no elementwise kernel after
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")  # CPU: torch's is erf's


def _dequantized(weight, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit weight's data * scale in `dtype`, into a temporary (kernels/dequantize.py)."""
    return dequantize(weight.data, weight.scale, dtype)


def _fp8_gemm(q: torch.Tensor, q_scale: torch.Tensor, weight, bias: torch.Tensor, gelu: bool,
              dtype: torch.dtype) -> torch.Tensor:
    """(q * q_scale) @ (weight.data * weight.scale).T + bias in `dtype`, then GELU(tanh) if
    asked: q float8_e4m3fn [M, K] with its rows' scales [M, 1]; cuBLASLt applies both scales
    and the bias to the fp32 sums (W's transpose is column-major, as it needs). It takes no
    bias into a float32 output on CUDA: there the bias is added after."""
    in_epilogue = dtype != torch.float32 or not q.is_cuda
    y = torch._scaled_mm(q, weight.data.t(), scale_a=q_scale, scale_b=weight.scale.view(1, -1),
                         bias=bias if in_epilogue else None, out_dtype=dtype)
    if not in_epilogue and bias is not None:
        y += bias
    return F.gelu(y, approximate="tanh") if gelu else y


def _operands(weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W, None) for a 16-bit weight; (data, scale) for an 8-bit one."""
    return (weight, None) if isinstance(weight, torch.Tensor) else (weight.data, weight.scale)


def candidates(m: int, weight_dtype: torch.dtype | None) -> tuple[LinearConfig, ...]:
    """The configs the table times against the default path at M = m, for weights in
    weight_dtype (None: the activations')."""
    skinny = TILE_CANDIDATES if weight_dtype is None and m <= MAX_M else ()
    return skinny + (gemv_candidates(weight_dtype is not None) if m <= gemv.MAX_M else ())


def measure_linear_wins(shapes: list[tuple[int, int, bool, bool]], batch_sizes: list[int],
                        dtype: torch.dtype, device: torch.device,
                        weight_dtype: torch.dtype | None = None
                        ) -> dict[ShapeKey, LinearConfig]:
    """For each (N, K, gelu, norm) and M among batch_sizes, time each candidate config against
    the default path inside CUDA graphs (as a captured decode step), weights (in weight_dtype:
    8-bit with their scales; None: dtype) rotated so they stream from memory as in a real
    step."""
    compile_candidates(shapes, batch_sizes, dtype, device, weight_dtype)
    itemsize = (weight_dtype or dtype).itemsize
    wins = {}
    for n, k, gelu, norm in shapes:
        weights = [_timing_weight(n, k, dtype, device, weight_dtype)
                   for _ in range(max(2, (256 << 20) // (n * k * itemsize)))][:16]
        bias = torch.randn(n, dtype=dtype, device=device)
        ln_w, ln_b = (torch.randn(k, dtype=dtype, device=device) for _ in range(2))
        for m in (m for m in batch_sizes if candidates(m, weight_dtype)):
            x, residual = (torch.randn(m, k, dtype=dtype, device=device) for _ in range(2))
            key = (n, k, m, gelu, norm)
            paths = {None: LinearDispatch(),
                     **{c: LinearDispatch({key: c}) for c in candidates(m, weight_dtype)}}
            times = {config: _graph_ms_if_fits(layer_call(dispatch, x, residual, ln_w, ln_b,
                                                          bias, norm, gelu), weights)
                     for config, dispatch in paths.items()}
            best = min(times, key=times.get)
            if best is not None:
                wins[key] = best
            log.info("linear N=%d K=%d M=%d gelu=%s norm=%s: default %.4f ms, %s", n, k, m,
                     gelu, norm, times.pop(None),
                     ", ".join(f"{type(c).__name__}{tuple(c)} {t:.4f}" for c, t in times.items()))
    return wins


def _timing_weight(n: int, k: int, dtype: torch.dtype, device: torch.device,
                   weight_dtype: torch.dtype | None) -> torch.Tensor | Weight8:
    if weight_dtype is not None:
        return random_weight8(n, k, weight_dtype, device)
    return torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5


def compile_candidates(shapes: list[tuple[int, int, bool, bool]], batch_sizes: list[int],
                       dtype: torch.dtype, device: torch.device,
                       weight_dtype: torch.dtype | None = None,
                       configs: tuple[LinearConfig, ...] | None = None) -> None:
    """Compile every variant measure_linear_wins times (or those of `configs` at every batch
    size), up front in a thread pool (Triton compiles mostly outside the GIL). Needs
    triton.AsyncCompileMode with ignore_errors, else they compile one by one as timed; a
    variant failing here fails again, loudly, when timed."""
    if not shapes:
        return
    async_compile = getattr(triton, "AsyncCompileMode", None)
    if async_compile is None or "ignore_errors" not in inspect.signature(async_compile).parameters:
        log.info("this Triton has no AsyncCompileMode(ignore_errors): the linear kernels' "
                 "variants compile one at a time as they are timed")
        return
    start, threads, count = time.perf_counter(), min(32, os.cpu_count() or 1), 0
    with ThreadPoolExecutor(threads) as pool, async_compile(pool, ignore_errors=True):
        for n, k, gelu, norm in shapes:
            weight = _timing_weight(n, k, dtype, device, weight_dtype)
            bias, ln_w, ln_b = (torch.empty(d, dtype=dtype, device=device) for d in (n, k, k))
            for m in batch_sizes:
                x, residual = (torch.empty(m, k, dtype=dtype, device=device) for _ in range(2))
                add_norm = AddNorm(residual, ln_w, ln_b, 1e-5) if norm else None
                for config in configs or candidates(m, weight_dtype):
                    count += 1
                    if isinstance(config, GemvConfig):
                        compile_gemv(x, *_operands(weight), bias, gelu, add_norm, config)
                    else:
                        compile_skinny(x, weight, bias, gelu, add_norm, config)
    log.info("compiled %d linear kernel variants (shape x batch size x config) in %.1f s on %d "
             "threads", count, time.perf_counter() - start, threads)


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
