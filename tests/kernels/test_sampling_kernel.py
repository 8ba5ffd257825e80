"""The one-launch row sampler: greedy rows match torch.argmax (ties and NaN included), sampled
rows draw the reference's token, from the same hashed Gumbel noise. The masked sampler draws
the same tokens from the rows with their banned tokens at -inf, writing only its rows."""
import pytest
import torch

from engine.worker import layers
from engine.worker.layers import gumbel_noise
from engine.worker.layers import masked_sample as masked_sample_reference
from engine.worker.layers import sample as sample_reference
from kernel_cases import DEVICE, DTYPES
from kernels import sampling
from kernels.sampling import CHUNK, masked_row_sample, row_sample


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


def test_draws_land_in_a_given_out_and_only_its_rows():
    """`out=`, as the step graphs pass a slice of their StepOutputs: the draws are written
    there (the same tensor returned), the tokens drawn without it, and the buffer's other rows
    keep their values; the reference does the same."""
    logits = torch.randn(5, 3000, device=DEVICE)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3], device=DEVICE)
    seeds = random_seeds(5)
    for draw in (row_sample, sample_reference):
        buffer = torch.full((7,), -5, dtype=torch.int64, device=DEVICE)
        returned = draw(logits, temperature, seeds, out=buffer[:5])
        assert returned.data_ptr() == buffer.data_ptr()
        assert buffer[:5].tolist() == draw(logits, temperature, seeds).tolist()
        assert buffer[5:].tolist() == [-5, -5]


def test_same_seed_same_draw_other_seed_other_draw():
    logits = torch.zeros(64, 1000, device=DEVICE)  # uniform: the draw is the noise's argmax
    temperature = torch.ones(64, device=DEVICE)
    seeds = torch.full((64,), 12345, dtype=torch.int64, device=DEVICE)
    seeds[32:] = 2 ** 40 + 7
    out = row_sample(logits, temperature, seeds).cpu()
    assert len(set(out[:32].tolist())) == 1 and len(set(out[32:].tolist())) == 1
    assert out[0] != out[32]


UNTOUCHED = -5  # what out holds in the rows a masked draw must not write


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> int32 [R, ceil(V / 32) + 1] (a spare word: masks may be wider)."""
    rows, vocab = allowed.shape
    padded = torch.zeros(rows, 32 * (-(-vocab // 32) + 1), dtype=torch.int64, device=DEVICE)
    padded[:, :vocab] = allowed.long()
    bits = torch.arange(32, device=DEVICE)
    words = (padded.view(rows, padded.shape[1] // 32, 32) << bits).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def masked(logits, rows, allowed, temperature, seeds, sample=masked_row_sample):
    out = torch.full((logits.shape[0],), UNTOUCHED, dtype=torch.int64, device=DEVICE)
    sample(logits, rows, pack_bitmask(allowed), temperature, seeds, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [50257, 77])
def test_masked_rows_draw_the_masked_logits_token(dtype, vocab):
    """Random masks (one row allows a single token) over a shuffled subset of the rows,
    greedy and sampled mixed: exactly row_sample's token on the rows with their banned tokens
    at -inf, the reference's up to a near-tie, always allowed, and only the rows written."""
    logits = (torch.randn(7, vocab, device=DEVICE) * 2).to(dtype)
    rows = torch.tensor([5, 0, 3, 6], device=DEVICE)
    density = torch.tensor([[0.5], [0.05], [0.9], [0.3]], device=DEVICE)
    allowed = torch.rand(4, vocab, device=DEVICE) < density
    allowed[1] = False
    allowed[1, vocab - 2] = True  # the one token row 0 may take
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.5], device=DEVICE)
    seeds = random_seeds(4)
    out = masked(logits, rows, allowed, temperature, seeds)
    banned_logits = logits[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(out[rows], row_sample(banned_logits, temperature, seeds))
    assert torch.all(allowed[torch.arange(4, device=DEVICE), out[rows]])
    assert out[0] == vocab - 2
    assert out[[1, 2, 4]].tolist() == [UNTOUCHED] * 3
    expected = masked(logits, rows, allowed, temperature, seeds, masked_sample_reference)
    scores = torch.where(temperature[:, None] > 0,
                         logits[rows].float() / temperature[:, None].clamp(min=1e-30)
                         + gumbel_noise(seeds, vocab), logits[rows].float())
    picked = torch.arange(4, device=DEVICE)
    gap = (scores[picked, expected[rows]] - scores[picked, out[rows]]).abs()
    assert torch.all((out[rows] == expected[rows]) | (gap < 1e-4)), (out, expected)
    assert out[[1, 2, 4]].tolist() == expected[[1, 2, 4]].tolist()


def test_masked_edge_rows():
    """NaN ranks last, +inf first (allowed: taken, banned: ignored), a row whose allowed
    tokens are all -inf or NaN takes its first allowed token, one that allows nothing 0; ties
    across chunks give the lowest allowed index. Greedy and sampled alike."""
    nan, inf = float("nan"), float("inf")
    vocab = 2 * CHUNK + 5
    logits = torch.randn(8, vocab, device=DEVICE)
    allowed = torch.zeros(8, vocab, dtype=torch.bool, device=DEVICE)
    allowed[0, [3, 9, CHUNK + 1]] = True  # NaN at 3, banned 50 at 4: 9 or CHUNK + 1
    logits[0, [3, 4, 9, CHUNK + 1]] = torch.tensor([nan, 50.0, 20.0, 10.0], device=DEVICE)
    allowed[1, [CHUNK + 7, 2 * CHUNK + 2]] = True  # all allowed -inf, banned finite
    logits[1, [CHUNK + 7, 2 * CHUNK + 2]] = -inf
    allowed[2, [5, 2 * CHUNK + 4]] = True  # all allowed NaN
    logits[2, [5, 2 * CHUNK + 4]] = nan
    allowed[3, ::3] = True  # +inf allowed, and banned +inf before it
    logits[3, [1, 2 * CHUNK + 1]] = inf
    logits[3, CHUNK + 2] = inf
    allowed[4, ::2] = True  # a row of NaN but two tokens: the larger allowed one
    logits[4] = nan
    logits[4, [6, 7, CHUNK + 10]] = torch.tensor([0.0, 5.0, 1.0], device=DEVICE)
    # row 5 allows nothing
    allowed[6] = True  # the same maximum in three chunks, a larger one banned
    allowed[6, 1] = False
    logits[6, [1, CHUNK + 5, 2 * CHUNK + 3, 2 * CHUNK]] = torch.tensor([200.0, 100.0, 100.0,
                                                                        100.0], device=DEVICE)
    allowed[7, [0, vocab - 1]] = True  # the last token
    logits[7, [0, vocab - 1]] = torch.tensor([-1.0, 1.0], device=DEVICE)
    rows = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], device=DEVICE)
    for temperature in (0.0, 1e-3):  # a tiny temperature: the noise cannot reorder these
        temperatures = torch.full((8,), temperature, device=DEVICE)
        temperatures[1] = 0.0  # row 6's tie holds for greedy only
        args = (rows, allowed[rows], temperatures, random_seeds(8))
        out = masked(logits, *args)
        expected = [9, CHUNK + 7, 5, CHUNK + 2, CHUNK + 10, 0, CHUNK + 5, vocab - 1]
        assert out.tolist() == expected, temperature
        assert masked(logits, *args, sample=masked_sample_reference).tolist() == expected


def test_masked_draw_of_no_rows_writes_nothing():
    logits = torch.randn(3, 100, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = masked(logits, none, torch.zeros(0, 100, dtype=torch.bool, device=DEVICE),
                 torch.zeros(0, device=DEVICE), none)
    assert out.tolist() == [UNTOUCHED] * 3
