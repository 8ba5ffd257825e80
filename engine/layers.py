"""The model's elementwise building blocks, as a swappable set of functions.

`TORCH_OPS` is the plain-PyTorch reference; `kernels.TRITON_OPS` provides fused Triton versions
with the same signatures. The model receives one `Ops` at construction (no global switch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (LayerNorm(x + residual), x + residual)."""
    summed = x + residual
    return layer_norm(summed, weight, bias, eps), summed


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (as GPT-2 uses) of x + bias."""
    return F.gelu(x + bias, approximate="tanh")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
           gelu: bool = False) -> torch.Tensor:
    """x @ weight.T + bias (weight in F.linear's [out, in] layout), then GELU(tanh) if asked."""
    return bias_gelu(F.linear(x, weight), bias) if gelu else F.linear(x, weight, bias)


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    norm_bias: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (linear(LayerNorm(x + residual), weight, bias, gelu), x + residual): the
    pre-norm block entry that a decode kernel can do in one launch."""
    normed, summed = add_layer_norm(x, residual, norm_weight, norm_bias, eps)
    return linear(normed, weight, bias, gelu), summed


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]: each row's first index of its maximum (greedy decoding)."""
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class Ops:
    layer_norm: Callable[..., torch.Tensor]
    add_layer_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    linear: Callable[..., torch.Tensor]  # linear(x, weight, bias, gelu=False)
    add_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    argmax: Callable[[torch.Tensor], torch.Tensor]


TORCH_OPS = Ops(layer_norm=layer_norm, add_layer_norm=add_layer_norm, linear=linear,
                add_norm_linear=add_norm_linear, argmax=argmax)
