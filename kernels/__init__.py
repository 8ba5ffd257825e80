"""Triton kernels for the GPU path. Each module keeps (or names) its plain-PyTorch reference;
tests/kernels compares every kernel with it, and scripts/bench_kernels.py times them."""
from engine.worker.layers import Ops
from kernels.layernorm import add_layer_norm, layer_norm
from kernels.linear import LinearDispatch, SkinnyWins
from kernels.sampling import row_sample


def triton_ops(skinny_wins: SkinnyWins | None = None) -> Ops:
    """Fused Triton ops; linear layers take the skinny GEMM for the measured winning shapes,
    in the tile config that won."""
    linear = LinearDispatch(skinny_wins)
    return Ops(layer_norm=layer_norm, add_layer_norm=add_layer_norm, linear=linear,
               add_norm_linear=linear.add_norm_linear, sample=row_sample)


TRITON_OPS = triton_ops()  # cuBLAS for every linear
