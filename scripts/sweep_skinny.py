"""Tile-config sweep of the skinny GEMM on GPT-2 layer shapes, against the unfused path
(cuBLAS, plus the add + LayerNorm kernel before QKV and FC), timed inside CUDA graphs with
weights rotated so they stream from memory as in a decode step. Its winners become the
candidates the startup table tries (kernels.skinny_gemm.TILE_CANDIDATES).

    python scripts/sweep_skinny.py --widths 768,1600 --m 1,4
"""
from __future__ import annotations

import argparse
import itertools

import torch

from kernels.linear import LinearDispatch, graph_ms, layer_call
from kernels.skinny_gemm import TileConfig

CONFIGS = [TileConfig(*knobs) for knobs in itertools.product(
    (16, 32, 64), (128, 256), (2, 4), (2, 3, 4, 5), (1, 2))]  # BN, BK, warps, stages, min steps


def layer_shapes(width: int) -> list[tuple[str, int, int, bool, bool]]:
    """(name, N, K, gelu, norm) of one GPT-2 block's linears."""
    return [("qkv", 3 * width, width, False, True), ("o", width, width, False, False),
            ("fc", 4 * width, width, True, True), ("proj", width, 4 * width, False, False)]


def sweep(width: int, m: int) -> None:
    dtype, device = torch.float16, torch.device("cuda")
    for name, n, k, gelu, norm in layer_shapes(width):
        weights = [torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5 for _ in range(16)]
        bias = torch.randn(n, dtype=dtype, device=device)
        x, residual = (torch.randn(m, k, dtype=dtype, device=device) for _ in range(2))
        ln_w, ln_b = (torch.randn(k, dtype=dtype, device=device) for _ in range(2))

        def time_ms(config: TileConfig | None) -> float:
            dispatch = LinearDispatch({(n, k, m, gelu, norm): config} if config else None)
            return graph_ms(layer_call(dispatch, x, residual, ln_w, ln_b, bias, norm, gelu),
                            weights)

        unfused, default = time_ms(None), time_ms(TileConfig())
        times = sorted((time_ms(config), config) for config in CONFIGS)
        gb_per_s = n * k * dtype.itemsize / times[0][0] / 1e6
        print(f"{name} N={n} K={k} M={m}: unfused {unfused * 1e3:.2f} us, default "
              f"{default * 1e3:.2f} us, best {times[0][0] * 1e3:.2f} us ({gb_per_s:.0f} GB/s) "
              f"{tuple(times[0][1])}; next "
              f"{', '.join(f'{t * 1e3:.2f} {tuple(c)}' for t, c in times[1:4])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="768,1600")
    parser.add_argument("--m", default="1,4")
    args = parser.parse_args()
    for width in (int(w) for w in args.widths.split(",")):
        for m in (int(m) for m in args.m.split(",")):
            sweep(width, m)


if __name__ == "__main__":
    main()
