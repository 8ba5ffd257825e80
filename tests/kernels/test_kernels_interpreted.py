"""Runs the Triton kernel tests (tests/kernels) on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before triton is first imported, so they run in a child pytest;
on a CUDA machine tests/kernels is collected natively instead and this test skips."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/kernels runs natively on CUDA")
def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
