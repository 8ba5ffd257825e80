"""The one-launch row argmax matches torch.argmax, ties and NaN included."""
import pytest
import torch

from engine.layers import argmax as argmax_reference
from kernel_cases import DEVICE, DTYPES
from kernels.argmax import CHUNK, row_argmax


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 50257), (3, CHUNK + 1), (64, 1000), (2, 7)])
def test_row_argmax_matches_reference(dtype, rows, vocab):
    logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    out = row_argmax(logits)
    assert torch.equal(out.cpu(), argmax_reference(logits).cpu())


def test_row_argmax_edge_rows():
    """Ties across chunks give the first index; NaN ranks highest; -inf rows give 0."""
    logits = torch.randn(4, 3 * CHUNK, device=DEVICE)
    logits[0, [CHUNK + 5, 2 * CHUNK + 7, 9]] = 100.0  # the same maximum in three chunks
    logits[1, 2 * CHUNK + 3] = float("nan")
    logits[2] = -float("inf")
    logits[3, 3 * CHUNK - 1] = 50.0  # last element
    assert row_argmax(logits).cpu().tolist() == [9, 2 * CHUNK + 3, 0, 3 * CHUNK - 1]
    assert row_argmax(logits).cpu().tolist() == argmax_reference(logits).cpu().tolist()
