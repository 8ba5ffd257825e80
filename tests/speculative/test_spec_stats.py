"""Speculative decoding counters: what each verified row adds, under vLLM's names."""
import pytest

from engine.speculative.stats import Counter, SpecDecodingStats, Vector


def test_rows_add_drafts_accepted_and_per_position_counts():
    stats = SpecDecodingStats(num_speculative_tokens=4)
    for drafts, accepted in [(4, 4), (4, 1), (2, 0), (0, 0), (3, 2)]:
        stats.observe(drafts, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 13, 7)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1, 1]
    assert stats.acceptance_rate == pytest.approx(7 / 13)
    assert stats.mean_acceptance_length == pytest.approx(1 + 7 / 4)


def test_metrics_carry_vllm_names():
    stats = SpecDecodingStats(num_speculative_tokens=2)
    stats.observe(2, 1)
    assert stats.metrics() == [
        Counter("vllm:spec_decode_num_drafts", 1),
        Counter("vllm:spec_decode_num_draft_tokens", 2),
        Counter("vllm:spec_decode_num_accepted_tokens", 1),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [1, 0])]


def test_no_drafts_yet_reads_as_zero_rate():
    stats = SpecDecodingStats(num_speculative_tokens=3)
    assert (stats.acceptance_rate, stats.mean_acceptance_length) == (0.0, 1.0)


@pytest.mark.parametrize("drafts, accepted", [(2, 3), (5, 1), (1, -1)])
def test_impossible_rows_are_rejected(drafts, accepted):
    with pytest.raises(ValueError, match="accepted"):
        SpecDecodingStats(num_speculative_tokens=4).observe(drafts, accepted)
