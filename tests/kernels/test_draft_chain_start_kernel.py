import pytest
import torch

from engine.speculative.draft_model.chain_start import chain_start as chain_start_reference
from kernel_cases import DEVICE
from kernels.draft_chain_start import draft_chain_start


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("iterations", [1, 4])
def test_draft_chain_start_matches_the_reference(rows, iterations):
    """Random rows (padding among them: no drafts), accepted counts from none to all (all:
    two token rows, packed), block tables of random blocks: the kernel writes every output
    entry, padding token rows too, as the reference does."""
    block_size, width, max_batch = 16, 8, rows + 3
    counts = torch.randint(0, iterations + 1, (rows,), dtype=torch.int32)
    accepted = (torch.rand(rows) * (counts + 1).float()).int().clamp(max=counts)
    accepted[:rows // 2] = counts[:rows // 2]  # more rows that feed their last draft too
    drafts = torch.randint(0, 50257, (max_batch, iterations + 2))[:, 1:1 + iterations]
    inputs = dict(
        positions=torch.randint(1, block_size * width - 2 * iterations - 2, (rows,)),
        next_tokens=torch.randint(0, 50257, (rows,)), draft_counts=counts,
        block_tables=torch.randint(0, 1000, (max_batch, width), dtype=torch.int32)[:rows],
        last_drafts=drafts[:rows], num_accepted=accepted, block_size=block_size)
    inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    shapes = dict(plan_positions=((iterations, rows), torch.int64),
                  plan_slots=((iterations, rows), torch.int64),
                  plan_seq_lens=((iterations, rows), torch.int32),
                  plan_drafted=((iterations, rows), torch.bool),
                  first_tokens=((2 * rows,), torch.int64),
                  first_positions=((2 * rows,), torch.int64),
                  first_slots=((2 * rows,), torch.int64),
                  first_query_starts=((rows + 1,), torch.int32),
                  first_rows=((rows,), torch.int64))
    expected = {k: torch.full(s, 7, dtype=d, device=DEVICE) for k, (s, d) in shapes.items()}
    got = {k: torch.full(s, 7, dtype=d, device=DEVICE) for k, (s, d) in shapes.items()}
    chain_start_reference(**inputs, **expected)
    draft_chain_start(**inputs, **got)
    for name in shapes:
        assert torch.equal(got[name], expected[name]), name
