"""The one-launch row sampler: greedy rows match torch.argmax (ties and NaN included), sampled
rows draw the reference's token, from the same hashed Gumbel noise."""
import pytest
import torch

from engine.worker import layers
from engine.worker.layers import gumbel_noise
from engine.worker.layers import sample as sample_reference
from kernel_cases import DEVICE, DTYPES
from kernels import sampling
from kernels.sampling import CHUNK, row_sample


def test_kernel_hashes_with_the_reference_multipliers():
    assert sampling.HASH_MULTIPLIERS == layers.HASH_MULTIPLIERS


def random_seeds(rows: int) -> torch.Tensor:
    return torch.randint(0, 2 ** 63 - 1, (rows,), dtype=torch.int64, device=DEVICE)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    rows = logits.shape[0]
    return row_sample(logits, torch.zeros(rows, device=DEVICE), random_seeds(rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 50257), (3, CHUNK + 1), (64, 1000), (2, 7)])
def test_greedy_rows_match_argmax(dtype, rows, vocab):
    logits = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    assert torch.equal(greedy(logits).cpu(), logits.argmax(dim=-1).cpu())


def test_greedy_edge_rows():
    """Ties across chunks give the first index; NaN ranks highest; -inf rows give 0."""
    logits = torch.randn(4, 3 * CHUNK, device=DEVICE)
    logits[0, [CHUNK + 5, 2 * CHUNK + 7, 9]] = 100.0  # the same maximum in three chunks
    logits[1, 2 * CHUNK + 3] = float("nan")
    logits[2] = -float("inf")
    logits[3, 3 * CHUNK - 1] = 50.0  # last element
    assert greedy(logits).cpu().tolist() == [9, 2 * CHUNK + 3, 0, 3 * CHUNK - 1]
    assert greedy(logits).cpu().tolist() == logits.argmax(dim=-1).cpu().tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 50257), (5, CHUNK + 3), (64, 1000)])
def test_sampled_rows_match_reference(dtype, rows, vocab):
    """Mixed greedy and sampled rows. Kernel and reference may round a score's log
    differently by an ulp, so a different pick is allowed only at a near-tie."""
    logits = (torch.randn(rows, vocab, device=DEVICE) * 2).to(dtype)
    temperature = torch.rand(rows, device=DEVICE) * 2
    temperature[::3] = 0.0
    seeds = random_seeds(rows)
    out = row_sample(logits, temperature, seeds)
    expected = sample_reference(logits, temperature, seeds)
    scores = torch.where(temperature[:, None] > 0,
                         logits.float() / temperature[:, None].clamp(min=1e-30)
                         + gumbel_noise(seeds, vocab), logits.float())
    rows_idx = torch.arange(rows, device=DEVICE)
    gap = (scores[rows_idx, expected] - scores[rows_idx, out]).abs()
    assert torch.all((out == expected) | (gap < 1e-4)), (out, expected)
    assert (out == expected).float().mean() > 0.9
    if rows >= 5:  # noise was added
        assert not torch.equal(out[1::3], logits[1::3].argmax(-1))


def test_same_seed_same_draw_other_seed_other_draw():
    logits = torch.zeros(64, 1000, device=DEVICE)  # uniform: the draw is the noise's argmax
    temperature = torch.ones(64, device=DEVICE)
    seeds = torch.full((64,), 12345, dtype=torch.int64, device=DEVICE)
    seeds[32:] = 2 ** 40 + 7
    out = row_sample(logits, temperature, seeds).cpu()
    assert len(set(out[:32].tolist())) == 1 and len(set(out[32:].tolist())) == 1
    assert out[0] != out[32]
