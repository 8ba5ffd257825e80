"""Every Triton kernel keeps the PDL contract (kernels/pdl.py): on Hopper it is launched while
the kernel before it is finishing, so it must wait before it reads another kernel's output or
writes anything. A kernel added without the wait would race only on the GPU, and only at times;
this checks the source instead, on every machine."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import torch
from triton.runtime.jit import KernelInterface

import kernels
from kernels.pdl import pdl_options

WAITS = ("pdl_prologue(USE_PDL)", "wait_for_inputs(USE_PDL)")
# index maths, letting dependents start, and the skinny GEMM's prefetch of weights (never written)
BEFORE_WAIT_ALLOWED = re.compile(r"= tl\.program_id\(|= tl\.minimum\(|^\s*\w+ = \w+ \* \w+( \+ "
                                 r"tl\.arange\(0, \w+\))?$|allow_dependents\(|"
                                 r"_prefetch_weights\(|^\s*if PREFETCH and USE_PDL:$")


def launched_kernels() -> list[KernelInterface]:
    """The @triton.jit functions named *_kernel (what launchers call; helpers are inlined)."""
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        found += [obj for name, obj in vars(module).items()
                  if isinstance(obj, KernelInterface) and name.endswith("_kernel")
                  and obj.fn.__module__ == module.__name__]
    return found


def test_every_kernel_waits_for_its_inputs_before_any_memory_access():
    found = launched_kernels()
    assert len(found) >= 7  # store_kv, decode, prefill, layer_norm, bias_gelu, skinny, argmax
    for kernel in found:
        assert "USE_PDL" in kernel.arg_names, kernel.fn.__name__
        body = inspect.getsource(kernel.fn).split("):\n", 1)[1].splitlines()
        wait_line = next(i for i, line in enumerate(body) if any(w in line for w in WAITS))
        for line in body[:wait_line]:
            assert BEFORE_WAIT_ALLOWED.search(line), f"{kernel.fn.__name__}: {line.strip()!r}"


def test_cpu_launches_never_use_pdl():
    assert pdl_options(torch.device("cpu")) == {"USE_PDL": False}
