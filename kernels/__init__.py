"""Triton kernels for the GPU path. Each module keeps (or names) its plain-PyTorch reference;
tests/kernels compares every kernel with it, and scripts/bench_kernels.py times them. Nothing
here imports engine/: the engine's adapter is engine/worker/triton_ops.py."""
