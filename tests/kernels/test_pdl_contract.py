"""Every Triton kernel keeps the PDL contract (kernels/pdl.py): on Hopper it is launched while
the kernel before it is finishing, so it must wait before it reads another kernel's output or
writes anything. A kernel added without the wait would race only on the GPU, and only at times;
this checks the source instead, on every machine."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

import torch
from triton.runtime.jit import KernelInterface

import kernels
from kernels import pdl
from kernels.pdl import pdl_options


def launched_kernels() -> list[KernelInterface]:
    """The @triton.jit functions named *_kernel (what launchers call; helpers are inlined)."""
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{info.name}")
        found += [obj for name, obj in vars(module).items()
                  if isinstance(obj, KernelInterface) and name.endswith("_kernel")
                  and obj.fn.__module__ == module.__name__]
    return found


def test_every_kernel_starts_with_the_pdl_prologue():
    found = launched_kernels()
    assert len(found) >= 7  # store_kv, decode, prefill, layer_norm, skinny, gemv, sample, ...
    for kernel in found:
        assert "USE_PDL" in kernel.arg_names, kernel.fn.__name__
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # docstring
        first = ast.unparse(body[0])
        assert (first == "pdl_prologue(USE_PDL)"
                or first.startswith("pdl_prologue_prefetching(USE_PDL, PREFETCH, ")
                or first.startswith("w = pdl_prologue_loading(USE_PDL, ")), first


def test_cpu_launches_never_use_pdl():
    assert pdl_options(torch.device("cpu")) == {"USE_PDL": False}


def test_the_pdl_switch_is_read_at_each_launch(monkeypatch):
    """On a device that supports PDL, GPT2_SERVE_PDL=0 turns it off for the next launch (no
    value cached from an earlier one), for A/B timings in one process."""
    monkeypatch.setattr(pdl, "_pdl_supported", lambda device: True)
    monkeypatch.delenv("GPT2_SERVE_PDL", raising=False)
    device = torch.device("cuda")
    assert pdl_options(device) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("GPT2_SERVE_PDL", "0")
    assert pdl_options(device) == {"USE_PDL": False}
    monkeypatch.delenv("GPT2_SERVE_PDL")
    assert pdl_options(device)["USE_PDL"]
