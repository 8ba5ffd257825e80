"""Tile-config sweep of the skinny GEMM on GPT-2 layer shapes, against the unfused path
(cuBLAS, plus the add + LayerNorm kernel before QKV and FC), timed inside CUDA graphs with
weights rotated so they stream from memory as in a decode step. Its winners become the
candidates the startup table tries (kernels.skinny_gemm.TILE_CANDIDATES). For the layers with
the norm fused in it also times the add + LayerNorm kernel followed by the plain skinny GEMM.

    python scripts/sweep_skinny.py --widths 768,1600 --m 1,4
    python scripts/sweep_skinny.py --widths 1600 --m 4,8,16 --layers qkv,fc
    python scripts/sweep_skinny.py --widths 1600 --m 1,4 --quantization int8
    python scripts/sweep_skinny.py --gemv --widths 768,1024,1280,1600 --m 1 [--quantization int8]

With --quantization, the 8-bit kernel (kernels/quant_linear.py) instead: its default tile
(tile_shape) and each config, against the 16-bit layer's best (cuBLAS or a startup-table
skinny config); GB/s counts the 8-bit weight bytes. At the rows where the engine takes
another route (kernels/linear.py: the fp8 GEMM, or the weight dequantized for cuBLAS) it times
that route too.

    python scripts/sweep_skinny.py --quantization fp8 --widths 1600 --m 17,64,256,512

With --routes, each layer as the engine runs it (LinearDispatch, the fp8 rule) for fp16, int8
(both routes: streamed 8-bit, dequantized for cuBLAS) and fp8 weights, and the block's four
linears summed per M:

    python scripts/sweep_skinny.py --routes --widths 1600 --m 8,17,32,48,64,65,128,256,512

With --gemv, the GEMV (kernels/gemv.py, M <= 2) over GEMV_CONFIGS against the default path
(cuBLAS, or quant_linear for 8-bit weights) and the startup table's GEMV candidates (--json
writes every time); its winners become kernels.linear's GEMV candidates (gemv_candidates).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

from engine.worker.layers import uses_fp8_gemm
from engine.worker.quantization import STORAGE, quantize_weight
from kernels.gemv import GemvConfig
from kernels.linear import (DEQUANT_MIN_ROWS, LinearDispatch, compile_candidates,
                            gemv_candidates, graph_ms, layer_call)
from kernels.quant_linear import (MAX_TILE_M, compile_quant_linear, quant_add_norm_linear,
                                  quant_linear)
from kernels.skinny_gemm import MAX_M, TILE_CANDIDATES, AddNorm, TileConfig

CONFIGS = tuple(TileConfig(*knobs) for knobs in itertools.product(
    (16, 32, 64), (64, 128, 256), (2, 4, 8), (2, 4), (1, 2)))  # BN, BK, warps, stages, steps
LAYERS = ("qkv", "o", "fc", "proj")
QUANT_CONFIGS = tuple(TileConfig(*knobs) for knobs in itertools.product(
    (16, 32, 64), (64, 128, 256), (2, 4, 8), (3,), (2,)))
# past MAX_TILE_M rows (a prefill's GEMM tile of LARGE_BLOCK_M rows): wider W tiles, more warps
LARGE_QUANT_CONFIGS = tuple(TileConfig(*knobs) for knobs in itertools.product(
    (64, 128), (32, 64, 128), (4, 8), (3, 4), (4,)))


GEMV_CONFIGS = tuple(GemvConfig(*knobs) for knobs in itertools.product(
    (4, 8, 16, 32), (128, 256, 512, 1024), (4, 8), (1,), (False, True),
    (1, 2, 4)))  # BN, BK, ..., per SM


def layer_shapes(width: int, layers: list[str]) -> list[tuple[str, int, int, bool, bool]]:
    """(name, N, K, gelu, norm) of one GPT-2 block's linears."""
    shapes = {"qkv": (3 * width, width, False, True), "o": (width, width, False, False),
              "fc": (4 * width, width, True, True), "proj": (width, 4 * width, False, False)}
    return [(name, *shapes[name]) for name in layers]


def rotated_weights(n: int, k: int, count: int = 16) -> list[torch.Tensor]:
    """`count` fp16 [N, K] weights on the GPU, to rotate through so each streams from memory."""
    return [torch.randn(n, k, dtype=torch.float16, device="cuda") * k ** -0.5
            for _ in range(count)]


def layer_operands(n: int, k: int, m: int) -> tuple[torch.Tensor, ...]:
    """(x, residual, ln_w, ln_b, bias) of an [M, K] -> N layer, layer_call's order."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float16, device="cuda")
    return randn(m, k), randn(m, k), randn(k), randn(k), randn(n)


def time_paths(n: int, k: int, m: int, gelu: bool, norm: bool) -> dict:
    """ms per layer of: the unfused path, each config fused (`norm`: add + LayerNorm in the
    kernel), and for norm layers each config of the plain kernel after the add + LayerNorm
    kernel ("ln+" keys)."""
    weights = rotated_weights(n, k)
    x, residual, ln_w, ln_b, bias = layer_operands(n, k, m)

    def time_ms(table: dict) -> float:
        call = layer_call(LinearDispatch(table), x, residual, ln_w, ln_b, bias, norm, gelu)
        return graph_ms(call, weights)

    times = {"unfused": time_ms({})}
    for config in CONFIGS:
        times[config] = time_ms({(n, k, m, gelu, norm): config})
        if norm:
            times["ln+", config] = time_ms({(n, k, m, gelu, False): config})
    return times


def sweep(width: int, m: int, layers: list[str]) -> None:
    for name, n, k, gelu, norm in layer_shapes(width, layers):
        times = time_paths(n, k, m, gelu, norm)
        unfused = times.pop("unfused")
        report = [("fused" if norm else "skinny",
                   sorted((t, c) for c, t in times.items() if isinstance(c, TileConfig)))]
        if norm:
            report.append(("ln+skinny", sorted((t, c[1]) for c, t in times.items()
                                               if not isinstance(c, TileConfig))))
        line = f"{name} N={n} K={k} M={m}: unfused {unfused * 1e3:.2f} us"
        for label, ranked in report:
            (best, config), rest = ranked[0], ranked[1:4]
            gb_per_s = n * k * 2 / best / 1e6
            line += (f"; {label} best {best * 1e3:.2f} us ({gb_per_s:.0f} GB/s) "
                     f"{tuple(config)}, next "
                     f"{', '.join(f'{t * 1e3:.2f} {tuple(c)}' for t, c in rest)}")
        print(line, flush=True)


def quant_call(x, residual, ln_w, ln_b, bias, norm: bool, gelu: bool,
               config: TileConfig | None):
    """The 8-bit layer for a QuantizedWeight passed in, with this tile (None: the default)."""
    if norm:
        add_norm = AddNorm(residual, ln_w, ln_b, 1e-5)
        return lambda w: quant_add_norm_linear(x, add_norm, w.data, w.scale, bias, gelu, config)
    return lambda w: quant_linear(x, w.data, w.scale, bias, gelu, config)


def _ms_if_fits(call, weights) -> float:
    try:
        return graph_ms(call, weights)
    except OutOfResources:
        return math.inf


def sweep_quant(width: int, m: int, layers: list[str], method: str) -> None:
    for name, n, k, gelu, norm in layer_shapes(width, layers):
        weights = rotated_weights(n, k)
        qweights = [quantize_weight(w, method) for w in weights]
        x, residual, ln_w, ln_b, bias = layer_operands(n, k, m)
        key = (n, k, m, gelu, norm)
        fp16 = min(graph_ms(layer_call(LinearDispatch(table), x, residual, ln_w, ln_b, bias,
                                       norm, gelu), weights)
                   for table in [{}] + [{key: c} for c in TILE_CANDIDATES if m <= MAX_M])
        args = (x, residual, ln_w, ln_b, bias, norm, gelu)
        default = graph_ms(quant_call(*args, None), qweights)
        route = ""
        if m >= DEQUANT_MIN_ROWS:  # the engine runs another route there
            route_ms = graph_ms(layer_call(LinearDispatch(None, uses_fp8_gemm), x, residual,
                                           ln_w, ln_b, bias, norm, gelu), qweights)
            kind = "fp8 GEMM" if norm and uses_fp8_gemm(m, qweights[0]) else "dequantized"
            route = f"engine's route ({kind}) {route_ms * 1e3:.2f} us; "
        configs = QUANT_CONFIGS if m <= MAX_TILE_M else LARGE_QUANT_CONFIGS
        with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool, \
                triton.AsyncCompileMode(pool, ignore_errors=True):  # compile all, then time
            for config in configs:
                fused = norm and m <= MAX_M  # else the norm runs as its own kernel
                compile_quant_linear(x, qweights[0].data, qweights[0].scale, bias, gelu,
                                     AddNorm(residual, ln_w, ln_b, 1e-5) if fused else None,
                                     config)
        times = sorted((_ms_if_fits(quant_call(*args, config), qweights), config)
                       for config in configs)
        best, config = times[0]
        print(f"{method} {name} N={n} K={k} M={m}: fp16 best {fp16 * 1e3:.2f} us; {route}8-bit "
              f"default {default * 1e3:.2f} us; best {best * 1e3:.2f} us "
              f"({n * k / best / 1e6:.0f} GB/s) {tuple(config)}; next "
              + ", ".join(f"{t * 1e3:.2f} {tuple(c)}" for t, c in times[1:6]), flush=True)


def time_routes(width: int, sizes: list[int], layers: list[str]) -> None:
    """Each layer as the engine runs it (LinearDispatch with the fp8 rule, no startup table)
    for fp16, int8 and fp8 weights, int8 both ways (streamed 8-bit, dequantized for cuBLAS:
    the engine's is the one DEQUANT_MIN_ROWS picks); then the block's total per M."""
    routes = {"fp16": LinearDispatch(), "int8 streamed": LinearDispatch(
        dequant_min_rows=math.inf), "int8 dequantized": LinearDispatch(
        dequant_min_rows=1), "fp8": LinearDispatch(None, uses_fp8_gemm)}
    totals: dict[tuple[int, str], float] = {}
    for name, n, k, gelu, norm in layer_shapes(width, layers):
        weights = rotated_weights(n, k)
        by_method = {"fp16": weights, **{q: [quantize_weight(w, q) for w in weights]
                                         for q in ("int8", "fp8")}}
        for m in sizes:
            x, residual, ln_w, ln_b, bias = layer_operands(n, k, m)
            times = {route: graph_ms(layer_call(dispatch, x, residual, ln_w, ln_b, bias, norm,
                                                gelu), by_method[route.split()[0]]) * 1e3
                     for route, dispatch in routes.items()}
            for route, t in times.items():
                totals[m, route] = totals.get((m, route), 0.0) + t
            print(f"{name} N={n} K={k} M={m}: " + ", ".join(f"{r} {t:.1f} us"
                                                           for r, t in times.items()), flush=True)
    for m in sizes:
        engine = "dequantized" if m >= DEQUANT_MIN_ROWS else "streamed"
        print(f"width {width} M={m}, {'+'.join(layers)} (int8 {engine} in the engine): "
              + ", ".join(f"{r} {totals[m, r]:.1f} us" for r in routes))


def sweep_gemv(widths: list[int], m: int, layers: list[str], method: str | None) -> list[dict]:
    """Per layer: ms of the default path, of each GEMV config and of the candidates' best."""
    dtype, device = torch.float16, torch.device("cuda")
    shapes = [(n, k, gelu, norm) for width in widths
              for _, n, k, gelu, norm in layer_shapes(width, layers)]
    compile_candidates(shapes, [m], dtype, device, STORAGE[method] if method else None,
                       configs=GEMV_CONFIGS)
    rows = []
    for n, k, gelu, norm in shapes:
        weights = rotated_weights(n, k, max(8, (200 << 20) // (n * k * (1 if method else 2))))
        if method:
            weights = [quantize_weight(w, method) for w in weights]
        x, residual, ln_w, ln_b, bias = layer_operands(n, k, m)
        key = (n, k, m, gelu, norm)
        times = {config: _ms_if_fits(layer_call(LinearDispatch({key: config} if config else {}),
                                                x, residual, ln_w, ln_b, bias, norm, gelu),
                                     weights)
                 for config in (None, *GEMV_CONFIGS)}
        default = times.pop(None)
        ranked = sorted((t, c) for c, t in times.items())
        chosen = min(times[c] for c in gemv_candidates(method is not None))
        print(f"{method or 'fp16'} N={n} K={k} M={m} norm={norm}: default {default * 1e3:.2f} us; "
              f"GEMV candidates {chosen * 1e3:.2f} us; best {ranked[0][0] * 1e3:.2f} us "
              f"({n * k * (1 if method else 2) / ranked[0][0] / 1e6:.0f} GB/s) "
              f"{tuple(ranked[0][1])}; next "
              + ", ".join(f"{t * 1e3:.2f} {tuple(c)}" for t, c in ranked[1:4]), flush=True)
        rows.append({"weights": method or "fp16", "n": n, "k": k, "m": m, "norm": norm,
                     "default_us": default * 1e3,
                     "gemv_us": {str(tuple(c)): t * 1e3 for c, t in times.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="768,1600")
    parser.add_argument("--m", default="1,4")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--quantization", choices=("int8", "fp8"))
    parser.add_argument("--gemv", action="store_true")
    parser.add_argument("--json", help="with --gemv: write every time here")
    parser.add_argument("--routes", action="store_true",
                        help="each layer as the engine runs it, fp16 / int8 / fp8, and totals")
    args = parser.parse_args()
    widths, sizes = ([int(v) for v in text.split(",")] for text in (args.widths, args.m))
    layers = args.layers.split(",")
    if args.routes:
        for width in widths:
            time_routes(width, sizes, layers)
        return
    if args.gemv:
        rows = [row for m in sizes for row in sweep_gemv(widths, m, layers, args.quantization)]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    if args.quantization:
        for width, m in itertools.product(widths, sizes):
            sweep_quant(width, m, layers, args.quantization)
        return
    shapes = [(n, k, gelu, norm) for width in widths
              for _, n, k, gelu, norm in layer_shapes(width, layers)]
    shapes += [(n, k, gelu, False) for n, k, gelu, norm in shapes if norm]
    compile_candidates(shapes, sizes, torch.float16, torch.device("cuda"), configs=CONFIGS)
    for width in widths:
        for m in sizes:
            sweep(width, m, layers)


if __name__ == "__main__":
    main()
