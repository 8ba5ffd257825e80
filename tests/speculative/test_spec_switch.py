"""Adaptive switch-off: the cost model speculates at small batches and stops at large ones."""
import random

import pytest

from engine.speculative.switch import (AcceptanceEstimate, SpeculationSwitch, StepTimes,
                                       expected_tokens, verdict)

BATCHES = (1, 4, 8, 16, 32, 128)


def step_time(rows):
    """A model of one GPU: weight-bound (2.5 ms) until the rows' compute takes longer."""
    return max(2.5e-3, rows * 4.7e-5)


PLAIN = tuple(step_time(b) for b in BATCHES)
# verifying B rows of k + 1 tokens costs like B (k + 1) rows, plus a host proposer
TIMES = StepTimes(BATCHES, PLAIN, {k: tuple(step_time(b * (k + 1)) + 2e-5 * b for b in BATCHES)
                                   for k in (2, 4, 6)})


def switch_at(rate):
    return SpeculationSwitch(TIMES, acceptance=AcceptanceEstimate(prior=rate, prior_weight=1e9))


@pytest.mark.parametrize("a, k, tokens", [(0.7, 4, 2.7731), (1.0, 4, 5.0), (0.0, 6, 1.0),
                                          (0.5, 2, 1.75)])
def test_expected_tokens_per_step(a, k, tokens):
    assert expected_tokens(a, k) == pytest.approx(tokens)


def test_drafts_shorten_as_the_batch_grows_then_stop():
    # batch 16, a = 0.7: k = 2 gains 2.19 tokens per 2.82 ms, k = 4 2.77 per 4.08 ms, plain
    # 1 per 2.5 ms; at 128 even k = 2 (2.19 per 18.1 ms) loses to plain (1 per 6.0 ms)
    assert [switch_at(0.7).choose(b) for b in (1, 8, 16, 32, 128)] == [6, 6, 2, 2, 0]


def test_no_acceptance_no_speculation():
    assert switch_at(0.0).choose(1) == 0


def test_fewer_acceptances_give_shorter_drafts():
    assert [switch_at(a).choose(8) for a in (0.98, 0.7, 0.45)] == [6, 6, 4]
    assert switch_at(0.45).choose(32) == 0 and switch_at(0.98).choose(32) == 6


def test_hysteresis_holds_the_current_choice_near_the_break_even():
    times = StepTimes((1,), (1.0,), {2: (expected_tokens(0.5, 2) / 1.02,)})  # spec 2 % ahead
    switch = SpeculationSwitch(times, acceptance=AcceptanceEstimate(0.5, 1e9))
    assert switch.choose(1) == 0  # starts off, and speculation does not win by 5 %
    switch.k = 2
    assert switch.choose(1) == 2  # once on, it stays: plain does not win by 5 % either


def test_interpolates_between_measured_batches():
    assert TIMES.at(PLAIN, 80) == pytest.approx((PLAIN[-2] + PLAIN[-1]) / 2)
    assert TIMES.at(PLAIN, 1) == PLAIN[0] and TIMES.at(PLAIN, 500) == PLAIN[-1]


def test_acceptance_estimate_finds_the_rate_from_truncated_runs():
    rng, k, true_rate = random.Random(0), 4, 0.8
    estimate = AcceptanceEstimate(prior=0.1, decay=0.9995)
    for _ in range(20000):
        accepted = 0
        while accepted < k and rng.random() < true_rate:
            accepted += 1
        estimate.observe(k, accepted)
    assert estimate.rate == pytest.approx(true_rate, abs=0.03)


def test_the_switch_learns_acceptance_from_verified_rows():
    switch = SpeculationSwitch(TIMES)  # prior 0.5
    for _ in range(2000):
        switch.observe(4, 0)  # every first draft rejected
    assert switch.choose(1) == 0
    for _ in range(2000):
        switch.observe(4, 4)
    assert switch.choose(1) > 0


def test_from_the_default_prior_a_stream_of_rejections_stops_within_a_few_steps():
    """Each step the prior keeps speculation on wastes a verification step: on an H100 a
    gpt2-xl one (1.24 decode steps) over a 64-token reply made the first ~23 steps cost
    0.90x with a prior worth 10 drafts."""
    times = StepTimes((1, 128), (2.5e-3, 6e-3),
                      {k: (2.5e-3 * 1.24, 6e-3 * (k + 1)) for k in (2, 4, 6)})
    switch = SpeculationSwitch(times)
    speculating = 0
    for _ in range(100):
        k = switch.choose(1)
        if k:
            speculating += 1
            switch.observe(k, 0)
    assert 0 < speculating <= 12


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_sizes": (8, 1)}, "ascend"), ({"plain": (1.0,)}, "plain"),
    ({"speculative": {0: PLAIN}}, "k >= 1"), ({"speculative": {2: (0.0,) * 6}}, "positive")])
def test_step_times_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepTimes(**{"batch_sizes": BATCHES, "plain": PLAIN, "speculative": {2: PLAIN},
                     **kwargs})


def test_a_switched_off_speculator_probes_now_and_then_and_relearns():
    switch = SpeculationSwitch(TIMES, acceptance=AcceptanceEstimate(0.0, 10.0), probe_every=8)
    choices = [switch.choose(1) for _ in range(16)]
    assert choices == [0] * 7 + [2] + [0] * 7 + [2]  # off, but the shortest k every 8th step
    assert [switch.choose(128) for _ in range(8)] == [0] * 8  # nothing could win: no probe
    for _ in range(50):
        switch.observe(2, 2)  # the probes' drafts are accepted: the workload changed
    assert switch.choose(1) > 0 and switch.k > 0


def test_the_verdict_names_the_acceptance_each_batch_needs():
    """Weight-bound at batch 1 (drafts nearly free: a little acceptance pays), compute-bound
    at 128 (verifying k + 1 tokens a row costs k + 1 steps: nothing pays)."""
    line = verdict(TIMES)
    assert line.startswith("speculation pays at batch 1: acceptance >= 0.")
    assert line.endswith("batch 128: never")
    one = float(line.split("batch 1: acceptance >= ")[1].split(";")[0])
    assert 0 < one <= 0.2
    assert all(expected_tokens(one, k) / TIMES.speculative[k][0] > PLAIN[0] ** -1 * 1.05
               for k in (2,))  # at that rate, k = 2 beats plain decoding by the margin


def test_speculation_can_be_told_to_run_every_step(monkeypatch, caplog):
    """adaptive false: no step times are measured, even on CUDA, so the speculator has no
    switch and every step drafts k."""
    from types import SimpleNamespace

    from engine import build
    from engine.core.config import EngineConfig

    config = EngineConfig.from_flat(speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 3,
                                                        "adaptive": False})
    cuda_runner = SimpleNamespace(device=SimpleNamespace(type="cuda"), num_kv_blocks=64)
    with caplog.at_level("INFO", logger="engine.build"):
        assert build.measured_step_times(config, cuda_runner) is None
    assert "every step drafts 3 tokens (adaptive is false)" in caplog.text
    core = build.build_engine_core(config, cuda_runner)
    assert core.speculator.switch is None and core.speculator.begin_step(256) == 3
    monkeypatch.setattr("engine.speculative.timing.measure_step_times",
                        lambda *args: TIMES)
    adaptive = EngineConfig.from_flat(speculative_config={"method": "ngram",
                                                          "num_speculative_tokens": 3})
    with caplog.at_level("INFO", logger="engine.build"):
        assert build.measured_step_times(adaptive, cuda_runner) is TIMES
    assert "speculation pays at batch 1: acceptance >= " in caplog.text
