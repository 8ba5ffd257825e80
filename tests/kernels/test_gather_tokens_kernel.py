"""gather_tokens: the kernel against its reference (engine.worker.layers): placeholders from
the previous draws, the rest from the staged tokens, over more rows than one program takes."""
import pytest
import torch

from engine.worker.layers import gather_tokens as reference
from kernel_cases import DEVICE, INTERPRET
from kernels.gather_tokens import BLOCK, gather_tokens


@pytest.mark.parametrize("rows", [1, 37, BLOCK + 5] if INTERPRET else [1, 37, 3 * BLOCK + 5])
def test_rows_read_the_previous_draws_or_their_own_tokens(rows):
    num_prev = rows + 3
    prev = torch.randint(0, 50257, (num_prev + 1,), device=DEVICE)
    own = torch.randint(0, 50257, (rows,), device=DEVICE)
    placeholder = torch.rand(rows, device=DEVICE) < 0.5
    source = torch.where(placeholder, torch.randint(0, num_prev, (rows,), device=DEVICE),
                         num_prev + torch.randperm(rows, device=DEVICE))
    got = gather_tokens(prev, own, source, num_prev)
    expected = torch.where(placeholder, prev[source.clamp(max=num_prev - 1)],
                           own[(source - num_prev).clamp(min=0)])
    assert torch.equal(got, expected)
    assert torch.equal(reference(prev, own, source, num_prev), expected)
