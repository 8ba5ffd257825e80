"""Triton kernels for the GPU path. Each module keeps (or names) its plain-PyTorch reference;
tests/kernels compares every kernel with it, and scripts/bench_kernels.py times them."""
from engine.layers import Ops
from kernels.gelu import bias_gelu
from kernels.layernorm import add_layer_norm, layer_norm

TRITON_OPS = Ops(layer_norm=layer_norm, add_layer_norm=add_layer_norm, bias_gelu=bias_gelu)
