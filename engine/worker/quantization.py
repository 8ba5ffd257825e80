"""8-bit weights (vLLM's `quantization="int8"` / `"fp8"`): at load, the four linears of every
block (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj) become `QuantizedLinear`s, whose
`weight` is a `QuantizedWeight` (engine/worker/layers.py) that every `Ops` linear takes:

    scale[n] = max_k |W[n, k]| / QMAX        one float32 per output channel (row of W)
    data[n]  = W[n] / scale[n]               int8: rounded (QMAX 127); fp8 e4m3: cast (448)

Symmetric, so zero stays exact and no zero point is needed. The embedding (tied with the LM
head), position embedding, LayerNorms and biases stay at the model's dtype, as do the
activations: the kernels are weight-only (W8A16, kernels/quant_linear.py; from 65 rows a
weight is dequantized for a 16-bit GEMM), but for an fp8 QKV or FC weight over
FP8_GEMM_MIN_ROWS rows or more, whose linear quantizes its rows too for an fp8 tensor-core GEMM
(engine/worker/layers.py, kernels/linear.py). At fp16 the weights
shrink to 53 % (gpt2-xl) to 66 % (gpt2: the 16-bit embedding is a larger share); KV sizing
measures the memory left after the load, so what they free goes to the KV cache.

A draft model (speculative_config's "model") loads through its own ModelRunner with the
target's ModelConfig, so it is quantized by the same method: it proposes from its own 8-bit
weights, and the quantized target verifies; its verification decides every emitted token, the
drafts only how many a step accepts.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.worker.layers import QuantizedWeight

log = logging.getLogger(__name__)
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}  # int8: symmetric (-128 unused); e4m3's largest finite
BLOCK_LINEARS = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """weight [out, in] -> its 8-bit form with per-row scales (module doc); a row of zeros
    keeps scale 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX[method], 1.0)
    scaled = (w / scale[:, None]).clamp(-QMAX[method], QMAX[method])  # fp8: no NaN past 448
    data = scaled.round() if method == "int8" else scaled
    return QuantizedWeight(data.to(STORAGE[method]).contiguous(), scale.contiguous())


class QuantizedLinear(nn.Module):
    """A block linear with 8-bit weights: buffers `qweight` [out, in] and `scale` [out], the
    bias as the nn.Linear's. `weight` is their QuantizedWeight, so the model passes
    `linear.weight` to `ops` as it does an nn.Linear's."""

    def __init__(self, weight: QuantizedWeight, bias: nn.Parameter) -> None:
        super().__init__()
        self.register_buffer("qweight", weight.data)
        self.register_buffer("scale", weight.scale)
        self.bias = bias

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scale)


def quantize_linears(model: nn.Module, method: str | None) -> None:
    """Quantize the block linears of a loaded GPT2 (`model.h`) in place by `method` ("int8",
    "fp8"; None: leave it), one at a time (each 16-bit weight is freed as it goes), and log
    the weight bytes before and after."""
    if method is None:
        return
    check_supported(method, model.wte.weight.device)
    before = weight_bytes(model)
    for block in model.h:
        quantize_block(block, method)
    after = weight_bytes(model)
    log.info("quantization %s: weights %.1f MiB -> %.1f MiB (the blocks' linears 8-bit with "
             "a scale per output channel); the %.1f MiB saved go to the KV cache", method,
             before / 2**20, after / 2**20, (before - after) / 2**20)


def quantize_block(block: nn.Module, method: str) -> None:
    """A model Block's four linears become QuantizedLinears by `method`, one at a time."""
    for parent_name, name in BLOCK_LINEARS:
        parent = getattr(block, parent_name)
        linear = getattr(parent, name)
        setattr(parent, name, QuantizedLinear(quantize_weight(linear.weight, method),
                                              linear.bias))


def check_supported(method: str, device: torch.device) -> None:
    """ValueError unless `device` runs `method`: fp8 e4m3 needs compute capability 8.9
    (Ada, Hopper), where the kernel's e4m3 conversions exist."""
    if (method == "fp8" and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(f"quantization='fp8' needs a GPU of compute capability 8.9 or newer "
                         f"(this one: {torch.cuda.get_device_name(device)}); use 'int8'")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers."""
    return sum(t.numel() * t.element_size()
               for t in (*model.parameters(), *model.buffers()))
