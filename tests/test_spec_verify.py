"""Verification of speculative drafts (CPU): greedy prefixes exactly, the sampled path's
distribution by chi-square, and seeded reproducibility."""
import functools

import pytest
import torch

from engine.worker import layers
from engine.worker.spec_verify import NO_TOKEN, accept_uniforms, verify

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


@pytest.mark.parametrize("dense", [False, True])
def test_greedy_rows_take_the_longest_matching_prefix(dense):
    argmaxes, drafts, num_drafts, expected = map(list, zip(*GREEDY_CASES))
    rows = len(argmaxes)
    # greedy ignores q: a dense q that favours other tokens must not change the outcome
    q = torch.softmax(torch.randn(rows, 3, 8), -1) if dense else None
    out = verify(one_hot_logits(argmaxes), torch.tensor(drafts), torch.tensor(num_drafts),
                 torch.zeros(rows), torch.randint(0, 2 ** 62, (rows, 4)), q)
    assert out.token_ids.tolist() == expected
    assert out.num_accepted.tolist() == [3, 1, 0, 2, 0]
    assert out.num_emitted.tolist() == [4, 2, 1, 3, 1]


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


@pytest.mark.parametrize("dense", [False, True])
def test_padding_past_a_rows_drafts_is_ignored(dense):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 8, generator=gen)
    q = torch.softmax(torch.randn(3, 3, 8, generator=gen), -1) if dense else None
    drafts = logits[:, :3].argmax(-1)
    num_drafts = torch.tensor([3, 1, 0])
    seeds = torch.randint(0, 2 ** 62, (3, 4), generator=gen)
    args = (num_drafts, torch.full((3,), 0.5), seeds, q)
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
def sampled_verification(one_hot: bool):
    """DRAWS rows of the same target, each with its own seeds and a draft drawn from q."""
    gen = torch.Generator().manual_seed(7)
    q = torch.softmax(DRAFT / TEMPERATURE, -1)
    drafts = torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=gen)
                          for i in range(K)], 1)
    if one_hot:  # an n-gram's q is one-hot at whatever it guessed: any drafts do
        drafts = torch.randint(0, VOCAB, (DRAWS, K), generator=gen)
    out = verify(TARGET.expand(DRAWS, -1, -1), drafts, torch.full((DRAWS,), K),
                 torch.full((DRAWS,), TEMPERATURE),
                 torch.randint(0, 2 ** 62, (DRAWS, K + 1), generator=gen),
                 None if one_hot else q.expand(DRAWS, -1, -1))
    return out, drafts


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot q", "dense q"])
def test_first_token_is_distributed_as_the_target(one_hot):
    out, _ = sampled_verification(one_hot)
    observed = torch.bincount(out.token_ids[:, 0], minlength=VOCAB).double()
    expected = DRAWS * torch.softmax(TARGET[0].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) > 0.01
    # and speculation did happen: many drafts were accepted, not every one
    assert 0.1 * DRAWS < out.num_accepted.sum() < DRAWS * K


def test_chi_square_detects_the_draft_distribution():
    """The test has power: the draft's own q (accepting everything) fails it."""
    _, drafts = sampled_verification(one_hot=False)
    observed = torch.bincount(drafts[:, 0], minlength=VOCAB).double()
    expected = DRAWS * torch.softmax(TARGET[0].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) < 1e-6


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot q", "dense q"])
def test_second_token_after_an_accepted_first_is_distributed_as_the_target(one_hot):
    """Given the first draft accepted, the next token follows the target at position 1."""
    out, _ = sampled_verification(one_hot)
    second = out.token_ids[out.num_accepted >= 1, 1]
    observed = torch.bincount(second, minlength=VOCAB).double()
    expected = len(second) * torch.softmax(TARGET[1].double() / TEMPERATURE, -1)
    assert chi_square_p_value(observed, expected) > 0.01


@pytest.mark.parametrize("one_hot", [True, False])
def test_a_seeded_row_is_reproducible_and_batch_independent(one_hot):
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 16, 3, 50
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    q = None if one_hot else torch.softmax(torch.randn(rows, k, vocab, generator=gen), -1)
    drafts = logits[:, :k].argmax(-1)  # likely drafts, so runs get long
    args = (drafts, torch.full((rows,), k), torch.full((rows,), 1.0))
    seeds = torch.randint(0, 2 ** 62, (rows, k + 1), generator=gen)
    first = verify(logits, *args, seeds, q)
    again = verify(logits, *args, seeds, q)
    assert torch.equal(first.token_ids, again.token_ids)
    alone = verify(logits[5:6], *(a[5:6] for a in args), seeds[5:6], None if q is None else q[5:6])
    assert torch.equal(alone.token_ids[0], first.token_ids[5])
    reseeded = verify(logits, *args, seeds + 1, q)
    assert not torch.equal(reseeded.token_ids, first.token_ids)


def test_accept_uniforms_are_uniform_and_apart_from_the_noise():
    seeds = torch.randint(0, 2 ** 62, (100000,), generator=torch.Generator().manual_seed(5))
    u = accept_uniforms(seeds)
    assert ((u > 0) & (u < 1)).all()
    deciles = torch.bincount((u * 10).long(), minlength=10).double()
    assert chi_square_p_value(deciles, torch.full((10,), 10000.0)) > 0.01
    # the race's uniform of token 0 under the same seed is another number altogether
    race = torch.exp(-torch.exp(-layers.gumbel_noise(seeds, 1)[:, 0]))
    assert abs(torch.corrcoef(torch.stack([u, race]))[0, 1]) < 0.02
