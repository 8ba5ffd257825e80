"""The pieces composed as the engine will compose them, on a tiny random GPT-2: a decoding
loop that proposes (n-gram, scripted drafts, or a draft model), scores the k + 1 positions with the
target in one forward, and verifies. Its output must equal plain decoding's, token for token,
greedy and seeded-sampled alike; this is the reference the integrated engine must match."""
import numpy as np
import pytest
import torch

from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import DraftContext
from engine.speculative.stats import SpecDecodingStats
from engine.worker import layers
from engine.worker.sampler import step_seed
from drafting import verify_one_hot
from fakes import ScriptedProposer, drafts_at_rate

STEPS, K, SEED = 40, 4, 1234
PROMPT = [17, 250, 3, 99, 42, 7] * 3  # repeats: the n-gram proposer finds matches


@pytest.fixture(scope="module")
def model():
    """Random GPT-2 weights with a 512-token vocabulary: the sampler's hashed noise over the
    real 50257 costs ~50 ms a row on a CI core, and the vocabulary changes nothing here."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def logits_of(model, tokens: list[int], last: int) -> torch.Tensor:
    """The target's logits at the last `last` positions of tokens: [last, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -last:]


def position_seeds(first_output: int, count: int) -> torch.Tensor:
    """The plain sampler's seed for each output position (seeded requests)."""
    return torch.tensor([[step_seed(SEED, first_output + i) for i in range(count)]])


@pytest.fixture(scope="module")
def plain(model):
    """Plain decoding's output per temperature, computed once."""
    return {temperature: plain_decode(model, temperature) for temperature in (0.0, 0.8)}


def plain_decode(model, temperature: float) -> list[int]:
    output: list[int] = []
    while len(output) < STEPS:
        logits = logits_of(model, PROMPT + output, 1)
        seeds = position_seeds(len(output), 1)[0]
        output.append(layers.sample(logits, torch.tensor([temperature]), seeds).item())
    return output


def speculative_decode(model, proposer, temperature: float, stats: SpecDecodingStats,
                       draft_model=None) -> list[int]:
    output: list[int] = []
    while len(output) < STEPS:
        context = DraftContext("r", PROMPT, output, min(K, STEPS - len(output) - 1))
        if draft_model is None:
            drafts = proposer.propose(context)
        else:
            drafts = greedy_drafts(draft_model, PROMPT + output, context.max_drafts)
        n = len(drafts)
        verified = verify_one_hot(logits_of(model, PROMPT + output + drafts, n + 1)[None],
                                  torch.tensor([drafts], dtype=torch.int64).view(1, n),
                                  torch.tensor([n]), torch.tensor([temperature]),
                                  position_seeds(len(output), n + 1))
        accepted = verified.num_accepted.item()
        stats.observe(n, accepted)
        output += verified.token_ids[0, :accepted + 1].tolist()
    return output


def greedy_drafts(draft_model, tokens: list[int], count: int) -> list[int]:
    """A draft model's proposal, as the engine's draft model makes it: count argmax tokens."""
    drafts: list[int] = []
    for _ in range(count):
        drafts.append(int(logits_of(draft_model, tokens + drafts, 1)[0].argmax()))
    return drafts


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_ngram_speculation_changes_no_token(model, plain, temperature):
    stats = SpecDecodingStats(K)
    got = speculative_decode(model, NgramProposer(1, 3), temperature, stats)
    assert got == plain[temperature]
    assert stats.num_drafts > 0  # the prompt repeats: n-grams matched and were verified
    if temperature == 0.0:
        assert stats.num_accepted_tokens > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("rate", [0.0, 0.7, 1.0])
def test_scripted_speculation_changes_no_token_and_accepts_as_set(model, plain, rate,
                                                                  temperature):
    """The drafts are plain decoding's own output (seeded: its own draws), each token kept
    with probability `rate`, so an intact draft is always accepted and a corrupted one never."""
    reference = plain[temperature]
    proposer = ScriptedProposer()
    proposer.add("r", drafts_at_rate(reference, rate, seed=5,
                                     vocab_size=model.config.vocab_size))
    stats = SpecDecodingStats(K)
    assert speculative_decode(model, proposer, temperature, stats) == reference
    if rate == 1.0:  # every step takes all drafts and the bonus: k + 1 tokens a step
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.num_drafts == -(-(STEPS - 1) // (K + 1))
    elif rate == 0.0:
        assert stats.num_accepted_tokens == 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_the_target_as_its_own_greedy_draft_is_always_accepted(model):
    """Greedy, the target drafting for itself guesses each argmax: every draft stays."""
    stats = SpecDecodingStats(K)
    output = speculative_decode(model, None, 0.0, stats, draft_model=model)
    assert len(output) == STEPS
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_draft_token_rows_and_host_drafts():
    """Drafts [2, 0, 1] over sampling rows [4 5 6 | 9 | 12 13]: the drafts sit in token rows
    5, 6 and 13, at flat indices 0, 1 and 4 of the [3, 2] drafts tensor, NO_TOKEN elsewhere."""
    from engine.core.batch import ScheduledSequence
    from engine.core.request import SamplingParams
    from engine.speculative.verify import NO_TOKEN, draft_token_rows, host_drafts

    greedy = SamplingParams(temperature=0.0)
    seqs = [ScheduledSequence(name, tokens, 7, (0,), True, greedy, num_drafts=n)
            for name, tokens, n in (("a", [1, 20, 21], 2), ("b", [2], 0), ("c", [3, 30], 1))]
    rows, flat = draft_token_rows(seqs, np.array([4, 5, 6, 9, 12, 13]), width=2)
    assert rows.tolist() == [5, 6, 13] and flat.tolist() == [0, 1, 4]
    drafts = host_drafts(seqs, torch.device("cpu"))
    assert drafts.tolist() == [[20, 21], [NO_TOKEN, NO_TOKEN], [30, NO_TOKEN]]
    assert drafts.view(-1)[torch.from_numpy(flat)].tolist() == [20, 21, 30]
