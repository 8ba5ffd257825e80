"""The one-launch logprobs kernel gives the reference's token logprob and top k (log-softmax of
the sanitised row, then gather and topk), subsets of rows, broken rows and ties included; with
ranks (prompt logprobs), each target's rank exactly, ties and broken rows included."""
import math

import pytest
import torch

from engine.worker.layers import prompt_logprobs as prompt_reference
from engine.worker.layers import sanitized_log_softmax
from engine.worker.layers import token_logprobs as reference
from kernel_cases import DEVICE, DTYPES
from kernels.logprobs import CHUNK, MAX_TOP, prompt_logprobs, token_logprobs


def check(logits: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor, k: int):
    got = token_logprobs(logits, rows, tokens, k)
    expected = reference(logits, rows, tokens, k)
    assert [t.dtype for t in got] == [torch.float32, torch.float32, torch.int64]
    assert torch.allclose(got[0], expected[0], atol=1e-4, rtol=1e-4, equal_nan=False)
    assert torch.allclose(got[1], expected[1], atol=1e-4, rtol=1e-4)
    return got, expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,k", [(1, 50257, 8), (4, 3 * CHUNK + 5, 20), (9, 1000, 1),
                                          (2, 7, 7), (3, 2 * CHUNK, 0)])
def test_matches_the_reference(dtype, rows, vocab, k):
    logits = (torch.randn(rows, vocab, device=DEVICE) * 3).to(dtype)
    tokens = torch.randint(0, vocab, (rows,), device=DEVICE)
    got, expected = check(logits, None, tokens, k)
    # ids may differ from torch's only among tied values: each id's logprob is its value
    logprobs = sanitized_log_softmax(logits)
    assert torch.allclose(logprobs.gather(1, got[2]), got[1], atol=1e-4, rtol=1e-4)
    assert all(len(set(row)) == k for row in got[2].tolist())


def test_a_subset_of_rows_reads_those_rows_and_their_tokens():
    logits = torch.randn(6, CHUNK + 100, device=DEVICE)
    tokens = torch.randint(0, CHUNK + 100, (6,), device=DEVICE)
    rows = torch.tensor([4, 0, 5], device=DEVICE)
    got, expected = check(logits, rows, tokens, 5)
    assert torch.equal(got[2], expected[2])
    alone = token_logprobs(logits[[4]], None, tokens[[4]], 5)
    assert torch.allclose(got[0][0], alone[0][0]) and torch.equal(got[2][0], alone[2][0])


def test_broken_rows_are_sanitised_as_the_reference_does():
    """NaN entries never rank; +inf entries share the mass; a row with nothing finite is
    uniform, its top ids the lowest."""
    vocab = 2 * CHUNK + 9
    logits = torch.randn(5, vocab, device=DEVICE)
    logits[0] = float("nan")
    logits[1] = -float("inf")
    logits[2, ::2] = float("nan")
    logits[3, CHUNK + 10] = float("inf")
    logits[4, [20, 2 * CHUNK + 1]] = float("inf")
    tokens = torch.tensor([3, 5, 0, CHUNK + 10, 20], device=DEVICE)
    token_lp, top_lp, top_ids = token_logprobs(logits, None, tokens, 4)
    expected = reference(logits, None, tokens, 4)
    assert torch.allclose(token_lp, expected[0], atol=1e-5)
    assert torch.allclose(top_lp, expected[1], atol=1e-5)
    assert token_lp[0].item() == pytest.approx(-math.log(vocab))
    assert top_ids[0].tolist() == top_ids[1].tolist() == [0, 1, 2, 3]
    assert token_lp[2].item() == -float("inf") and (top_ids[2] % 2 == 1).all()
    assert top_ids[3, 0].item() == CHUNK + 10 and token_lp[3].item() == pytest.approx(0.0)
    assert top_ids[4, :2].tolist() == [20, 2 * CHUNK + 1]
    assert top_lp[4, :2].tolist() == pytest.approx([-math.log(2)] * 2)


def test_ties_across_chunks_give_the_lowest_index_first():
    logits = torch.zeros(1, 3 * CHUNK, device=DEVICE)
    logits[0, [2 * CHUNK + 7, CHUNK + 5, 9]] = 5.0
    _, top_lp, top_ids = token_logprobs(logits, None, torch.zeros(1, dtype=torch.int64,
                                                                  device=DEVICE), 4)
    assert top_ids[0].tolist() == [9, CHUNK + 5, 2 * CHUNK + 7, 0]
    assert top_lp[0, 0] == top_lp[0, 2]


def test_the_widest_top_k():
    logits = torch.randn(2, 3000, device=DEVICE)
    tokens = torch.tensor([1, 2], device=DEVICE)
    got, expected = check(logits, None, tokens, MAX_TOP)
    assert torch.equal(got[2], expected[2])


def check_prompt(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """prompt_logprobs against the reference: ranks exact, logprobs within fp32 rounding, and
    the top k as token_logprobs gives them."""
    token_lp, ranks, top_lp, top_ids = prompt_logprobs(logits, targets, k)
    expected = prompt_reference(logits, targets, k)
    assert [t.dtype for t in (token_lp, ranks, top_lp, top_ids)] == [
        torch.float32, torch.int64, torch.float32, torch.int64]
    assert torch.equal(ranks, expected[1])
    assert torch.allclose(token_lp, expected[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(top_lp, expected[2], atol=1e-4, rtol=1e-4)
    plain = token_logprobs(logits, None, targets, k)
    assert torch.equal(token_lp, plain[0]) and torch.equal(top_ids, plain[2])
    return ranks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,k", [(1, 50257, 1), (5, 3 * CHUNK + 5, 20), (9, 1000, 0)])
def test_prompt_logprobs_rank_each_target_as_the_reference(dtype, rows, vocab, k):
    logits = (torch.randn(rows, vocab, device=DEVICE) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    targets[0] = logits[0].float().argmax()  # the likeliest token: rank 1
    ranks = check_prompt(logits, targets, k)
    assert ranks[0].item() == 1
    logprobs = sanitized_log_softmax(logits)  # vLLM's rank, over the log-softmax
    own = logprobs.gather(1, targets[:, None])
    assert torch.equal(ranks, (logprobs >= own).sum(-1))


def test_prompt_logprobs_ranks_count_ties_and_broken_rows():
    """Tied logits all count (a target tied with two others ranks 3rd of three at the top);
    NaN counts as -inf, +inf as the largest value; a row with nothing finite ranks every
    token V."""
    vocab = 2 * CHUNK + 9
    logits = torch.zeros(4, vocab, device=DEVICE)
    logits[0, [5, CHUNK + 1, 2 * CHUNK + 3]] = 2.0
    logits[1, ::3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = -float("inf")
    logits[3, 10] = float("nan")
    targets = torch.tensor([CHUNK + 1, 7, 4, 10], device=DEVICE)
    ranks = check_prompt(logits, targets, 2)
    assert ranks.tolist() == [3, 1, vocab, vocab]
