"""Triton kernels for the GPU path. Each module keeps (or names) its plain-PyTorch reference;
tests/kernels compares every kernel with it, and scripts/bench_kernels.py times them. The
engine reaches them only through kernels.backend."""
