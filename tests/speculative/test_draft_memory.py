"""The draft model's memory estimate counts the weights as loaded, 8-bit linears included."""
from pathlib import Path

import pytest
import torch

from engine.speculative.draft_model.method import GRAPH_MARGIN, draft_memory
from engine.worker.attention import TorchAttention
from engine.worker.layers import TORCH_OPS
from engine.worker.models.gpt2 import find_checkpoint, load_gpt2
from engine.worker.quantization import quantize_linears, weight_bytes


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
def test_weights_estimate_equals_the_loaded_bytes(tiny_checkpoint: Path, quantization):
    model_dir, config = find_checkpoint(str(tiny_checkpoint))
    model = load_gpt2(model_dir, config, torch.float32, "cpu", TORCH_OPS, TorchAttention())
    quantize_linears(model, quantization)
    logits = 8 * config.padded_vocab_size * 4
    _, beside_pool = draft_memory(config, 16, torch.float32, 8, quantization)
    assert beside_pool - logits - GRAPH_MARGIN == weight_bytes(model)
