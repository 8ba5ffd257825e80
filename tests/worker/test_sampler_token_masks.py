"""allowed_token_ids and bad words in the sampler, on hand-made logits; and that they take
the sampler's full path, the output so far, and no speculation."""
from __future__ import annotations

import pytest
import torch

from engine.core.batch import ScheduledSequence
from engine.core.request import Request, SamplingParams
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Speculator
from engine.worker.sampler import Sampler, is_plain_draw

VOCAB = 1000


def seq(params: SamplingParams, output: tuple[int, ...] = ()) -> ScheduledSequence:
    return ScheduledSequence("r", [0], 0, [0], True, params, output_token_ids=output,
                             num_output_tokens=len(output))


def sample(logits: torch.Tensor, seqs: list[ScheduledSequence], seed: int = 0) -> list[int]:
    return Sampler(seed)(logits, seqs).to_lists()[0]


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_best_allowed_token():
    logits = random_logits(16)
    allowed = (3, 500, 999, 17)
    rows = [seq(SamplingParams(temperature=0, allowed_token_ids=allowed))] * 8 + \
        [seq(SamplingParams(temperature=0))] * 8
    tokens = sample(logits, rows)
    best_allowed = [allowed[i] for i in logits[:8, list(allowed)].argmax(-1).tolist()]
    assert tokens[:8] == best_allowed
    assert tokens[8:] == logits[8:].argmax(-1).tolist()  # rows without the field: untouched
    assert tokens[:8] != logits[:8].argmax(-1).tolist()  # the mask changed something


def test_sampling_stays_inside_the_allowed_set():
    logits = torch.zeros(4000, VOCAB)  # uniform: every token equally likely
    logits[:, 7] = 50.0  # the unrestricted favourite, outside the set
    allowed = (21, 22, 23)
    tokens = sample(logits, [seq(SamplingParams(allowed_token_ids=allowed))] * 4000)
    assert set(tokens) == set(allowed)


def test_a_one_token_bad_word_is_never_sampled():
    logits = torch.zeros(4000, VOCAB)
    logits[:, 5] = 3.0  # the most likely token by far: banned
    logits[:, 9] = 2.0
    tokens = sample(logits, [seq(SamplingParams(bad_words_token_ids=((5,),)))] * 4000)
    assert 5 not in tokens and 9 in tokens


def test_a_multi_token_bad_word_is_masked_only_after_its_prefix():
    logits = random_logits(4)
    favourite = int(logits[0].argmax())
    word = ((40, 41, favourite),)
    params = SamplingParams(temperature=0, bad_words_token_ids=word)
    rows = [seq(params, (1, 40, 41)), seq(params, (40, 41, 2)), seq(params, (41,)),
            seq(params, ())]
    logits[:] = logits[0]
    tokens = sample(logits, rows)
    second = int(logits[0].topk(2).indices[1])
    assert tokens == [second, favourite, favourite, favourite]


def test_a_bad_word_longer_than_the_output_plus_one_is_not_masked():
    logits = random_logits(1)
    favourite = int(logits[0].argmax())
    params = SamplingParams(temperature=0, bad_words_token_ids=((1, 2, favourite),))
    assert sample(logits, [seq(params, (2,))]) == [favourite]


@pytest.mark.parametrize("params", [SamplingParams(allowed_token_ids=(1, 2)),
                                    SamplingParams(bad_words_token_ids=((1,),))])
def test_masks_take_the_full_path_and_never_speculate(params):
    assert not is_plain_draw([seq(params)])
    speculator = Speculator(NgramProposer(1, 3), num_speculative_tokens=3, max_model_len=64)
    assert speculator.may_speculate(Request("a", [1, 2], SamplingParams()))
    assert not speculator.may_speculate(Request("b", [1, 2], params))


def test_bad_words_need_the_output_so_far():
    assert SamplingParams(bad_words_token_ids=((1, 2),)).needs_output_tokens
    assert not SamplingParams(allowed_token_ids=(1,)).needs_output_tokens


@pytest.mark.parametrize("kwargs", [{"allowed_token_ids": ()}, {"allowed_token_ids": (-1,)},
                                    {"allowed_token_ids": (50257,)},
                                    {"bad_words_token_ids": ((),)},
                                    {"bad_words_token_ids": ((1, 50257),)}])
def test_invalid_masks_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
