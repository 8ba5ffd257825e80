"""Kernel tests run natively on CUDA, or on CPU under TRITON_INTERPRET=1 (set before triton is
imported, so test_kernels_interpreted.py runs this folder in a subprocess). In a plain CPU
process only that runner is collected, and in its interpreted child everything but it."""
import os
import zlib
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED_RUNNER = "test_kernels_interpreted.py"
if INTERPRET:
    collect_ignore = [INTERPRETED_RUNNER]
elif not torch.cuda.is_available():
    collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py")
                      if p.name != INTERPRETED_RUNNER]


def _interpreter_bf16_dot():
    """The interpreter (triton 3.9) stores bf16 as uint16 and its tl.dot multiplies those bit
    patterns. Widen bf16 operands to fp32 first (exact) so bf16 prefill is testable on CPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched(self, a, b, d, *args):
        return create_dot(self, widen(a), widen(b), d, *args)

    interpreter.InterpreterBuilder.create_dot = patched


if INTERPRET:
    _interpreter_bf16_dot()


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """torch.empty / empty_like return NaN-filled floats (ints: -7), so any output element or
    workspace entry a kernel forgets to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.fixture(autouse=True)
def seeded(request):
    """Fresh random inputs for every case, reproducible from its test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def counters_left_zeroed(request):
    """Every kernel that finishes split reductions through the shared arrival counters must
    leave them all zero, or the next launch would see a partial count. (The interpreted
    runner launches no kernel in this process.)"""
    yield
    if request.path.name == INTERPRETED_RUNNER:
        return
    from kernels.arrival_counters import arrival_counters

    device = torch.device("cpu" if INTERPRET else "cuda")
    assert not arrival_counters(device).any()
