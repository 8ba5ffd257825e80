"""Verification of speculative drafts (CPU): greedy prefixes exactly, the sampled path's
distribution by chi-square, and seeded reproducibility."""
import functools

import torch

from drafting import verify_one_hot as verify
from engine.speculative.verify import NO_TOKEN
from engine.worker import layers

N = NO_TOKEN


def one_hot_logits(argmaxes, vocab=8):
    """[R, k + 1, vocab] logits whose argmax at each position is given."""
    logits = torch.randn(len(argmaxes), len(argmaxes[0]), vocab, generator=torch.Generator()
                         .manual_seed(0))
    return logits.scatter(2, torch.tensor(argmaxes)[..., None], 10.0)


GREEDY_CASES = [  # (target argmax at k + 1 = 4 positions, drafts, num drafts, expected output)
    ([1, 2, 3, 4], [1, 2, 3], 3, [1, 2, 3, 4]),  # all accepted, then the bonus
    ([1, 2, 3, 4], [1, 5, 3], 3, [1, 2, N, N]),  # stops at the first mismatch
    ([1, 2, 3, 4], [6, 2, 3], 3, [1, N, N, N]),  # nothing accepted: the argmax
    ([1, 2, 3, 4], [1, 2, 7], 2, [1, 2, 3, N]),  # two drafts, both taken: bonus at 2
    ([1, 2, 3, 4], [0, 0, 0], 0, [1, N, N, N]),  # no drafts: a plain greedy step
]


def test_greedy_rows_take_the_longest_matching_prefix():
    argmaxes, drafts, num_drafts, expected = map(list, zip(*GREEDY_CASES))
    rows = len(argmaxes)
    out = verify(one_hot_logits(argmaxes), torch.tensor(drafts), torch.tensor(num_drafts),
                 torch.zeros(rows), torch.randint(0, 2 ** 62, (rows, 4)))
    assert out.token_ids.tolist() == expected
    assert out.num_accepted.tolist() == [3, 1, 0, 2, 0]


def test_one_hot_drafts_emit_what_the_plain_sampler_draws():
    """Seeded, speculation changes no token: each emitted token is the plain sampler's draw
    at that position with that position's seed."""
    rows, k, vocab = 64, 4, 6
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    temperature = torch.full((rows,), 0.7)
    seeds = torch.randint(0, 2 ** 62, (rows, k + 1), generator=gen)
    plain = torch.stack([layers.sample(logits[:, i], temperature, seeds[:, i])
                         for i in range(k + 1)], 1)
    # drafts right at random: some rows take a few
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.6, plain[:, :k],
                         torch.randint(0, vocab, (rows, k), generator=gen))
    out = verify(logits, drafts, torch.full((rows,), k), temperature, seeds)
    for row in range(rows):
        taken = out.num_accepted[row].item()
        assert drafts[row, :taken].tolist() == plain[row, :taken].tolist()
        assert taken == k or drafts[row, taken] != plain[row, taken]
        assert out.token_ids[row, :taken + 1].tolist() == plain[row, :taken + 1].tolist()
        assert (out.token_ids[row, taken + 1:] == N).all()
    assert 0 < out.num_accepted.sum() < rows * k


def test_padding_past_a_rows_drafts_is_ignored():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 8, generator=gen)
    drafts = logits[:, :3].argmax(-1)
    num_drafts = torch.tensor([3, 1, 0])
    seeds = torch.randint(0, 2 ** 62, (3, 4), generator=gen)
    args = (num_drafts, torch.full((3,), 0.5), seeds)
    padded = torch.where(torch.arange(3) < num_drafts[:, None], drafts, NO_TOKEN)
    assert torch.equal(verify(logits, padded, *args).token_ids,
                       verify(logits, drafts, *args).token_ids)


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic.double() / 2).item()


DRAWS, VOCAB, K, TEMPERATURE = 40000, 5, 2, 0.8
TARGET = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0], [0.3, 1.5, -1.0, 0.1, 0.6],
                       [0.0, 0.0, 1.0, -2.0, 0.5]])  # logits of the k + 1 positions
DRAFT = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 2.0, -1.0]])


@functools.cache  # three tests read the same 40000 draws
def sampled_verification():
    """DRAWS rows of the same target, each with its own seeds and drafts drawn from a draft
    distribution q; q is one-hot at whatever was guessed, so any drafts do."""
    gen = torch.Generator().manual_seed(7)
    q = torch.softmax(DRAFT / TEMPERATURE, -1)
    drafts = torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=gen)
                          for i in range(K)], 1)
    out = verify(TARGET.expand(DRAWS, -1, -1), drafts, torch.full((DRAWS,), K),
                 torch.full((DRAWS,), TEMPERATURE),
                 torch.randint(0, 2 ** 62, (DRAWS, K + 1), generator=gen))
    return out, drafts


def test_first_token_is_distributed_as_the_target():
    out, _ = sampled_verification()
    observed = torch.bincount(out.token_ids[:, 0], minlength=VOCAB).double()
    expected = DRAWS * torch.softmax(TARGET[0].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) > 0.01
    # and speculation did happen: many drafts were accepted, not every one
    assert 0.1 * DRAWS < out.num_accepted.sum() < DRAWS * K


def test_chi_square_detects_the_draft_distribution():
    """The test has power: the draft's own q (accepting everything) fails it."""
    _, drafts = sampled_verification()
    observed = torch.bincount(drafts[:, 0], minlength=VOCAB).double()
    expected = DRAWS * torch.softmax(TARGET[0].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) < 1e-6


def test_second_token_after_an_accepted_first_is_distributed_as_the_target():
    """Given the first draft accepted, the next token follows the target at position 1."""
    out, _ = sampled_verification()
    second = out.token_ids[out.num_accepted >= 1, 1]
    observed = torch.bincount(second, minlength=VOCAB).double()
    expected = len(second) * torch.softmax(TARGET[1].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) > 0.01


def test_a_seeded_row_is_reproducible_and_batch_independent():
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 16, 3, 50
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    drafts = logits[:, :k].argmax(-1)  # likely drafts, so runs get long
    args = (drafts, torch.full((rows,), k), torch.full((rows,), 1.0))
    seeds = torch.randint(0, 2 ** 62, (rows, k + 1), generator=gen)
    first = verify(logits, *args, seeds)
    again = verify(logits, *args, seeds)
    assert torch.equal(first.token_ids, again.token_ids)
    alone = verify(logits[5:6], *(a[5:6] for a in args), seeds[5:6])
    assert torch.equal(alone.token_ids[0], first.token_ids[5])
    reseeded = verify(logits, *args, seeds + 1)
    assert not torch.equal(reseeded.token_ids, first.token_ids)
