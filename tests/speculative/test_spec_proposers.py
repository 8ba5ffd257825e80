"""Proposers: n-gram prompt lookup (against a brute-force reference)."""
import pytest
from hypothesis import given, settings, strategies as st

from engine.speculative.ngram import NgramProposer
from engine.core.request import Request, SamplingParams
from engine.speculative.proposer import DraftContext


def context(tokens, num_prompt=None, max_drafts=4, request_id="r"):
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return DraftContext(request_id, tokens[:num_prompt], tokens[num_prompt:], max_drafts)


def brute_force_lookup(tokens, min_n, max_n, max_drafts):
    """Scan backwards from the end for the most recent earlier match, longest n first; copy
    what followed it token by token, past the end through the copy itself."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if n <= len(tokens) - 1 and tokens[end - n + 1:end + 1] == suffix:
                copied = list(tokens)
                for i in range(max_drafts):
                    copied.append(copied[end + 1 + i])
                return copied[len(tokens):]
    return []


def test_ngram_proposes_what_followed_the_last_tokens():
    #         the cat sat on the mat . the cat
    tokens = [1, 2, 3, 4, 1, 5, 6, 1, 2]
    assert NgramProposer(2, 4).propose(context(tokens)) == [3, 4, 1, 5]
    assert NgramProposer(2, 4).propose(context(tokens, max_drafts=2)) == [3, 4]


def test_ngram_prefers_the_longest_n_then_the_latest_match():
    # "8 1 2" occurred once (followed by 3); "1 2" most recently followed by 7
    tokens = [8, 1, 2, 3, 9, 1, 2, 7, 8, 1, 2]
    assert NgramProposer(2, 3).propose(context(tokens)) == [3, 9, 1, 2]
    assert NgramProposer(2, 2).propose(context(tokens)) == [7, 8, 1, 2]


def test_ngram_copies_a_loop_past_the_end():
    assert NgramProposer(1, 1).propose(context([4, 7, 7, 7])) == [7, 7, 7, 7]
    assert NgramProposer(2, 2).propose(context([7, 8, 9, 7, 8])) == [9, 7, 8, 9]


def test_ngram_without_a_match_or_room_proposes_nothing():
    assert NgramProposer(2, 4).propose(context([1, 2, 3, 4, 5])) == []
    assert NgramProposer(1, 1).propose(context([1, 2, 1], max_drafts=0)) == []
    assert NgramProposer(1, 1).propose(context([1])) == []


def test_ngram_reads_prompt_and_output_alike():
    tokens = [5, 6, 7, 8, 5, 6]
    for num_prompt in range(1, len(tokens) + 1):
        assert NgramProposer(2, 2).propose(context(tokens, num_prompt)) == [7, 8, 5, 6]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
       max_drafts=st.integers(0, 5), num_prompt=st.integers(1, 60))
def test_ngram_incremental_index_matches_brute_force(tokens, bounds, max_drafts, num_prompt):
    """Fed token by token, as decoding does, every proposal equals a full rescan's."""
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    num_prompt = min(num_prompt, len(tokens))
    proposer = NgramProposer(min_n, max_n)
    for length in range(num_prompt, len(tokens) + 1):
        got = proposer.propose(context(tokens[:length], num_prompt, max_drafts))
        assert got == brute_force_lookup(tokens[:length], min_n, max_n, max_drafts)


def test_ngram_release_and_reused_ids_start_fresh():
    proposer = NgramProposer(1, 2)
    assert proposer.propose(context([1, 2, 1, 2, 1])) == [2, 1, 2, 1]
    assert proposer.propose(context([3, 4, 3])) == [4, 3, 4, 3]  # shorter: another request
    proposer.release("r")
    # a longer request under the released id: its tokens are read from the start
    assert proposer.propose(context([5, 6, 5, 6, 5])) == [6, 5, 6, 5]


def test_ngram_rejects_bad_bounds():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


@pytest.mark.parametrize("prompt_len, outputs, max_tokens, max_model_len, expected", [
    (10, 0, 100, 1024, 4),  # room everywhere: k
    (10, 97, 100, 1024, 2),  # 3 tokens left: 2 drafts + the next token
    (10, 99, 100, 1024, 0),  # the last token: a plain step
    (1018, 2, 100, 1024, 3),  # context 1020 of 1024: 3 drafts + the next token
])
def test_draft_context_cuts_k_to_what_the_request_may_still_emit(prompt_len, outputs,
                                                                 max_tokens, max_model_len,
                                                                 expected):
    request = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    for token in range(outputs):
        request.append_output_token(token)
    view = DraftContext.of(request, k=4, max_model_len=max_model_len)
    assert view.max_drafts == expected
    assert view.num_tokens == prompt_len + outputs
    assert view.output_token_ids is request.output_token_ids  # a view, not a copy
