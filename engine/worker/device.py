"""The device, dtype and attention backend a config's "auto" resolves to, and their ops."""
from __future__ import annotations

import torch

from engine.core.config import EngineConfig
from engine.worker.cuda_graphs import GraphPlan
from engine.worker.layers import TORCH_OPS, Ops
from engine.worker.models.gpt2 import GPT2Config
from engine.worker.startup import StartupCache

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type != "cuda":
        raise ValueError("attention_backend='triton' needs device='cuda'")
    return name


def ops_for(backend: str, model_config: GPT2Config, config: EngineConfig, dtype: torch.dtype,
            device: torch.device, cache: StartupCache) -> tuple[Ops, str | None]:
    """The Triton backend's ops (imported lazily: CPU runs need no Triton), linears routed
    by this GPU's linear table (skinny GEMM, GEMV) at the graphs' row counts, for the weights
    as quantized, and blocks in one launch at the decode row counts where that was faster;
    and the table's source ("cached", "measured"; None: no table)."""
    if backend != "triton":
        return TORCH_OPS, None
    from engine.worker.triton_ops import (measured_one_launch_blocks, measured_triton_ops,
                                          triton_ops)

    if config.model.enforce_eager:
        return triton_ops(), None
    quantization = config.model.quantization
    ops, source = measured_triton_ops(model_config.linear_shapes,
                                      GraphPlan.of(config).linear_row_counts(), dtype, device,
                                      cache, quantization)
    return measured_one_launch_blocks(ops, model_config, dtype, device, cache, quantization,
                                      config.cache.block_size), source
