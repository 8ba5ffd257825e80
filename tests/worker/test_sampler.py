"""The sampler on hand-made logits: each stage against a reference computed in the test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.core.batch import PLACEHOLDER_TOKEN, GrammarMask, ScheduledSequence
from engine.core.request import EOS_TOKEN_ID, SamplingParams, StructuredOutputsParams
from engine.worker import layers
from engine.worker.layers import sanitized_log_softmax
from engine.worker.model_runner import PlainDecode
from engine.worker.sampler import Sampler, apply_penalties, sanitize

VOCAB = 1000


def seq(params: SamplingParams, num_output_tokens: int = 0, prompt: tuple[int, ...] = (),
        output: tuple[int, ...] = ()) -> ScheduledSequence:
    return ScheduledSequence("r", [0], 0, [0], True, params, output_token_ids=output,
                             prompt_token_ids=prompt,
                             num_output_tokens=num_output_tokens or len(output))


def run(logits: torch.Tensor, seqs: list[ScheduledSequence], seed: int = 0):
    return Sampler(seed)(logits, seqs).to_lists()


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(8)
    tokens, logprobs = run(logits, [seq(SamplingParams(temperature=0))] * 8)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 8


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(top_k=1, temperature=2.0)])
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = random_logits(64)
    tokens, _ = run(logits, [seq(params)] * 64)
    assert tokens == logits.argmax(-1).tolist()


def test_unfiltered_sampling_is_not_greedy():
    """Guards the tests above: without a filter, plain sampling draws other tokens too."""
    logits = random_logits(64) / 10
    tokens, _ = run(logits, [seq(SamplingParams())] * 64)
    assert tokens != logits.argmax(-1).tolist()


def draw_many(probs: list[float], params: SamplingParams, rows: int = 2000) -> set[int]:
    logits = torch.tensor(probs).log().expand(rows, -1).contiguous()
    tokens, _ = run(logits, [seq(params)] * rows)
    return set(tokens)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=2.0),
                                    SamplingParams(logprobs=0), SamplingParams(seed=5)],
                         ids=["plain", "hot", "filtered-path", "seeded"])
def test_draws_follow_the_softmax_at_the_temperature(params):
    """The hashed Gumbel-max race samples softmax(logits / T), on the plain path and on the
    full one (logprobs send a batch through every stage). Seeded rows advance their seed
    with the output position, so rows at different positions are independent draws."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 4000
    logits = probs.log().expand(rows, -1).contiguous()
    seqs = [seq(params, num_output_tokens=row) for row in range(rows)]
    tokens, _ = run(logits, seqs)
    expected = torch.softmax(probs.log() / (params.temperature or 1.0), -1)
    observed = torch.bincount(torch.tensor(tokens), minlength=4) / rows
    assert torch.allclose(observed, expected, atol=0.025), (observed, expected)


def test_min_p_keeps_tokens_above_fraction_of_the_top():
    probs = [0.5, 0.3, 0.15, 0.05]  # min_p 0.5 keeps p >= 0.25: tokens 0 and 1
    assert draw_many(probs, SamplingParams(min_p=0.5)) == {0, 1}
    assert draw_many(probs, SamplingParams(min_p=0.0)) == {0, 1, 2, 3}


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    assert draw_many(probs, SamplingParams(top_k=2)) == {1, 3}
    assert draw_many(probs, SamplingParams(top_p=0.8)) == {1, 3, 4}  # 0.4 + 0.3 < 0.8


def test_penalties_match_hand_computed_reference():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 2)
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = seq(params, prompt=(0, 1), output=(1, 3, 3))
    plain = seq(SamplingParams())
    # repetition over prompt + output (0, 1, 3): positive / 2, negative * 2;
    # then output counts {1: 1, 3: 2}: minus 0.25 * count + 0.5 * (count > 0)
    expected = torch.tensor([2.0 / 2, -1.0 * 2 - 0.25 - 0.5, 0.5,
                             3.0 / 2 - 0.5 - 0.5, -2.0, 0.0])
    out = apply_penalties(logits, [penalised, plain])
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], logits[1])
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    tokens, _ = run(logits, [seq(greedy, prompt=(0, 1), output=(1, 3, 3)),
                             seq(SamplingParams(temperature=0))])
    assert tokens == [0, 3]


def test_logit_bias_forces_a_token():
    logits = random_logits(16)
    params = [SamplingParams(logit_bias={7: 100.0}), SamplingParams(temperature=0,
                                                                    logit_bias={9: 100.0})]
    tokens, _ = run(logits, [seq(params[i % 2]) for i in range(16)])
    assert tokens == [7, 9] * 8


def eos_favoured_logits(rows: int) -> torch.Tensor:
    logits = torch.zeros(rows, EOS_TOKEN_ID + 1)
    logits[:, EOS_TOKEN_ID] = 50.0
    logits[:, 11] = 40.0
    return logits


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(11,))
    logits = eos_favoured_logits(4)
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    tokens, _ = run(logits, [seq(params, num_output_tokens=1), seq(params, num_output_tokens=3),
                             seq(ignore, num_output_tokens=0), seq(SamplingParams(temperature=0))])
    assert tokens[0] not in (EOS_TOKEN_ID, 11)
    assert tokens[1:] == [EOS_TOKEN_ID] * 3


def test_logprobs_are_raw_log_softmax_with_ordered_top_k():
    logits = random_logits(3)
    params = [SamplingParams(logprobs=5, temperature=0.7, logit_bias={3: 5.0}),
              SamplingParams(logprobs=0), SamplingParams()]
    tokens, logprobs = run(logits, [seq(p) for p in params])
    reference = torch.log_softmax(logits, -1)
    first = logprobs[0]
    assert first.token_logprob == pytest.approx(reference[0, tokens[0]].item(), abs=1e-5)
    top = reference[0].topk(5)
    assert first.top_token_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert logprobs[1].top_token_ids == [] and logprobs[1].top_logprobs == []
    assert logprobs[1].token_logprob == pytest.approx(reference[1, tokens[1]].item(), abs=1e-5)
    assert logprobs[2] is None


def test_seeded_request_ignores_its_batch():
    seeded = SamplingParams(seed=1234)
    logits = random_logits(1, seed=5) / 10  # flat enough that draws vary
    alone = [run(logits, [seq(seeded, num_output_tokens=step)], seed=0)[0][0]
             for step in range(8)]
    neighbours = [SamplingParams(temperature=0), SamplingParams(top_k=5, top_p=0.5),
                  SamplingParams(min_p=0.1, repetition_penalty=1.5)]
    in_batch = []
    for step in range(8):
        batch = torch.cat([random_logits(3, seed=step + 100), logits])
        seqs = [seq(p, output=(1, 2)) for p in neighbours] + [seq(seeded, num_output_tokens=step)]
        in_batch.append(run(batch, seqs, seed=step + 1)[0][3])
    assert alone == in_batch
    assert len(set(alone)) > 1  # the seed varies with the step
    other_seed = [run(logits, [seq(SamplingParams(seed=99), num_output_tokens=step)])[0][0]
                  for step in range(8)]
    assert other_seed != alone


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(32) / 10
    params = [seq(SamplingParams())] * 32
    assert run(logits, params, seed=3)[0] == run(logits, params, seed=3)[0]
    assert run(logits, params, seed=3)[0] != run(logits, params, seed=4)[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.5, logprobs=3),
    SamplingParams(top_k=3, top_p=0.5, min_p=0.2, seed=7, logprobs=3),
    SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, min_tokens=2, logprobs=3)])
def test_nan_and_inf_rows_give_valid_tokens(params):
    nan, inf = float("nan"), float("inf")
    logits = random_logits(5)
    logits[0] = nan
    logits[1] = -inf
    logits[2, ::2] = nan
    logits[3, 10] = inf
    logits[4, [20, 30]] = inf
    logits[4, 40] = -inf
    tokens, logprobs = run(logits, [seq(params, output=(1, 2)) for _ in range(5)])
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[3] == 10 and tokens[4] in (20, 30)
    assert tokens[2] % 2 == 1  # NaN entries can never be drawn
    assert all(math.isfinite(lp.token_logprob) for lp in logprobs)
    assert logprobs[0].token_logprob == pytest.approx(-math.log(VOCAB))


def test_a_draw_made_on_the_device_answers_plain_rows_only():
    """A CUDA graph draws every row at its temperature and seed; the sampler takes that draw
    when all rows are plain, and samples the logits itself when any row needs filters."""
    logits, drawn = random_logits(2), torch.tensor([7, 9])
    plain = [seq(SamplingParams(temperature=0.8)), seq(SamplingParams(temperature=0.0))]
    assert Sampler(0)(logits, plain, drawn=drawn).token_ids.tolist() == [7, 9]
    filtered = [seq(SamplingParams(top_k=1)), seq(SamplingParams(temperature=0.0))]
    assert Sampler(0)(logits, filtered, drawn=drawn).token_ids.tolist() == (
        logits.argmax(-1).tolist())


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=3),
                                    SamplingParams(top_k=20, top_p=0.8, seed=3, logprobs=2)],
                         ids=["plain", "filtered"])
def test_model_dtype_logits_sample_as_their_float32_widening(params):
    """Logits come in the model's dtype, as a view of padded rows (what lm_head returns); the
    sampler draws from them what it draws from the same values widened to float32."""
    padded = random_logits(4, VOCAB + 24).to(torch.bfloat16)
    logits = padded[:, :VOCAB]
    seqs = [seq(params)] * 4
    assert run(logits, seqs) == run(logits.float().contiguous(), seqs)


def pack_bitmask(allowed: np.ndarray) -> np.ndarray:
    """bool [R, V] -> a GrammarMask's int32 words, with a spare word: masks may be wider."""
    words = np.zeros((len(allowed), -(-allowed.shape[1] // 32) + 1), np.int64)
    for row, col in zip(*np.nonzero(allowed)):
        words[row, col // 32] |= 1 << (col % 32)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("graph_drew", [False, True], ids=["eager", "graph-drawn"])
@pytest.mark.parametrize("constrained", [(0, 2, 3), (0, 1, 2, 3, 4)], ids=["some", "all"])
def test_the_masked_draw_takes_only_allowed_tokens(graph_drew, constrained):
    """Plain rows beside structured-output ones: one masked draw of the constrained rows gives
    each the token its logits draw with the banned tokens at -inf (never a banned one), and
    the other rows keep their plain draw (the graph's, when it made one)."""
    rng = np.random.default_rng(1)
    allowed = rng.random((len(constrained), VOCAB)) < 0.05
    allowed[0] = False
    allowed[0, 123] = True
    spec = StructuredOutputsParams(regex="a")
    seqs = [ScheduledSequence(f"r{i}", [0], 0, [0], True, SamplingParams(
        temperature=t, structured_outputs=spec if i in constrained else None))
        for i, t in enumerate([0.0, 1.0, 0.7, 1.0, 0.0])]
    mask = GrammarMask([f"r{i}" for i in constrained], pack_bitmask(allowed))
    logits = random_logits(len(seqs))
    calls = []

    def masked_draw(*args):
        calls.append(args[1].tolist())
        layers.masked_sample(*args)

    sampler = Sampler(3, masked_draw=masked_draw)
    draw_inputs = sampler.draw_inputs(seqs)
    temperature, seeds = (torch.from_numpy(a) for a in draw_inputs)
    drawn = torch.tensor([7, 8, 9, 10, 11]) if graph_drew else None
    plain = drawn.clone() if graph_drew else layers.sample(logits, temperature, seeds)
    tokens = sampler(logits, seqs, draw_inputs, drawn, mask).token_ids
    rows = list(constrained)
    allowed_t = torch.from_numpy(allowed)
    expected = plain.clone()
    expected[rows] = layers.sample(logits[rows].masked_fill(~allowed_t, float("-inf")),
                                   temperature[rows], seeds[rows])
    assert tokens.tolist() == expected.tolist()
    assert allowed_t[torch.arange(len(rows)), tokens[rows]].all()
    assert tokens[0] == 123
    assert calls == [rows]
    for wrong in (None, GrammarMask(mask.request_ids[::-1], mask.bitmask)):
        with pytest.raises(ValueError, match="does not match"):
            sampler(logits, seqs, draw_inputs, drawn, wrong)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_the_masked_draw_graphs_redraw_the_step_rows_in_place(device, monkeypatch):
    """Over a step's StepOutputs, the graphs draw what the masked draw op draws for the
    constrained rows, and leave every other row of the step alone, as the row count shrinks
    and grows (the rows past it, whatever the staging held, draw into the spare row). On CPU
    the graphs are eager replays of the torch reference; on CUDA captured graphs of the
    kernel."""
    from eager_graphs import replay_masked_draw_eagerly
    from engine.worker.cuda_graphs import MaskedDrawGraphs, StepOutputs

    device, vocab, batch = torch.device(device), 1000, 16
    if device.type == "cuda":
        from kernels.sampling import masked_row_sample as masked_draw
    else:
        masked_draw = layers.masked_sample
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # no pinning on CPU
    words = -(-vocab // 32)
    step = StepOutputs(batch, 1024, vocab, torch.float16, device)
    graphs = MaskedDrawGraphs(masked_draw, step, words, batch, device)
    if device.type == "cuda":
        graphs.capture()
    else:
        replay_masked_draw_eagerly(graphs)
    rng = np.random.default_rng(0)
    for count in (8, 3, 13, 1, 5):
        logits = torch.randn(batch, vocab, device=device).half()
        step.logits[:batch, :vocab] = logits
        step.drawn[:batch] = torch.arange(100, 100 + batch)
        rows = np.sort(rng.choice(batch, count, replace=False)).astype(np.int64)
        bits = rng.random((count, words * 32)) < 0.1
        bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
        temperature = rng.choice([0.0, 0.7, 1.0], count).astype(np.float32)
        seeds = rng.integers(0, 2**62, count)
        expected = step.drawn[:batch].clone()
        masked_draw(logits, torch.from_numpy(rows).to(device),
                    torch.from_numpy(bitmask).to(device), torch.from_numpy(temperature).to(device),
                    torch.from_numpy(seeds).to(device), expected)
        assert graphs.takes(step.logits[:batch, :vocab], step.drawn[:batch], count)
        graphs.run(rows, bitmask, temperature, seeds)
        drawn = step.drawn[:batch].cpu()
        assert torch.equal(drawn, expected.cpu())
        assert bits[np.arange(count), drawn[rows]].all()
        others = np.setdiff1d(np.arange(batch), rows)
        assert drawn[others].tolist() == (100 + others).tolist()
    assert not graphs.takes(logits, step.drawn[:batch], 1)  # logits of its own: not a step's
    assert not graphs.takes(step.logits[:batch, :vocab], step.drawn[:batch], batch + 1)


def test_plain_draws_asking_for_logprobs_keep_the_graphs_draw():
    """Rows whose only extra is logprobs take the draw a decode graph made (`drawn`) and read
    their logprobs beside it; the other rows' logprobs stay None."""
    logits = random_logits(3)
    seqs = [seq(SamplingParams(temperature=0, logprobs=2)), seq(SamplingParams(temperature=0.7)),
            seq(SamplingParams(temperature=0.7, logprobs=1))]
    tokens, logprobs = Sampler()(logits, seqs, drawn=torch.tensor([5, 6, 7])).to_lists()
    assert tokens == [5, 6, 7]
    expected = torch.log_softmax(logits.float(), -1)
    assert logprobs[1] is None
    assert logprobs[0].token_logprob == pytest.approx(expected[0, 5].item(), abs=1e-5)
    assert logprobs[2].token_logprob == pytest.approx(expected[2, 7].item(), abs=1e-5)
    assert logprobs[0].top_token_ids == expected[0].topk(2).indices.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sanitized_log_softmax_equals_the_log_softmax_of_sanitised_logits(dtype):
    """The logprobs' log-softmax (three kernels) gives what sanitize then log_softmax give,
    broken rows included: NaN entries, +inf entries, a row with nothing finite."""
    logits = random_logits(5).to(dtype)
    logits[0] = float("nan")
    logits[1] = -float("inf")
    logits[2, ::2] = float("nan")
    logits[3, 10] = float("inf")
    logits[4, [20, 30]] = float("inf")
    expected = torch.log_softmax(sanitize(logits.float()), -1)
    got = sanitized_log_softmax(logits)
    assert got.dtype == torch.float32
    assert torch.allclose(got[[0, 1, 2]], expected[[0, 1, 2]], atol=1e-3)
    assert got[0].eq(-math.log(VOCAB)).all() and got[2, ::2].eq(-float("inf")).all()
    for row, hot in ((3, [10]), (4, [20, 30])):  # +inf is the largest finite value: it wins
        assert torch.allclose(got[row, hot].exp().sum(), torch.tensor(1.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("count", [1, 3, 8, 13])
def test_the_logprob_graphs_give_what_the_kernel_gives(count):
    """Rows gathered, the first rows of any logits, and the first rows of the StepOutputs
    (read in place)."""
    from engine.worker.cuda_graphs import LogprobGraphs, StepOutputs
    from kernels.logprobs import token_logprobs

    device, vocab, batch = torch.device("cuda"), 5000, 16
    step = StepOutputs(batch, vocab + 64, vocab, torch.float16, device)
    graphs = LogprobGraphs(token_logprobs, step, torch.float16, batch, device)
    graphs.capture()
    rng = np.random.default_rng(count)
    for k in (3, 0, 20):  # the buffers are reused from step to step
        logits = torch.randn(batch, vocab, device=device).half()
        tokens = torch.from_numpy(rng.integers(0, vocab, batch)).to(device)
        rows = torch.from_numpy(np.sort(rng.choice(batch, count, replace=False))).to(device)
        step.logits[:batch, :vocab] = logits
        step.drawn[:batch] = tokens
        cases = [(logits, rows, tokens), (logits[:count], None, tokens[:count]),
                 (step.logits[:count, :vocab], None, step.drawn[:count])]
        for case_logits, picked, case_tokens in cases:
            got = graphs.run(case_logits, picked, case_tokens, k)
            expected = token_logprobs(case_logits, picked, case_tokens, k)
            assert torch.equal(got[0], expected[0])
            assert torch.equal(got[1][:, :k], expected[1])
            assert torch.equal(got[2][:, :k], expected[2])
            assert got[1].shape[1] == (8 if k <= 8 else 20)  # the narrowest graph that holds k
    assert graphs.steps_in_place == 3
    assert graphs.takes(logits, batch) and not graphs.takes(logits.float(), 1)


def test_a_rows_gumbel_noise_depends_on_its_seed_alone_across_cpu_chunks():
    """gumbel_noise hashes GUMBEL_ROWS_CPU rows at a time on the CPU: every row, whichever
    chunk it falls in, equals the row hashed alone and the spec's uniforms at both seed
    extremes."""
    rows = 2 * layers.GUMBEL_ROWS_CPU + 3
    seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(1))
    seeds[0], seeds[-1] = 0, 2**63 - 1
    noise = layers.gumbel_noise(seeds, VOCAB)
    assert noise.shape == (rows, VOCAB) and noise.isfinite().all()
    for row in range(rows):
        alone = layers.gumbel_noise(seeds[row:row + 1], VOCAB)[0]
        assert torch.equal(noise[row], alone), row
    cols = torch.arange(VOCAB)
    uniform = layers.hashed_uniform(seeds[:, None], cols)
    assert torch.equal(noise, -torch.log(-torch.log(uniform)))
    assert 0 < uniform.min() and uniform.max() < 1


def test_a_continued_step_draws_at_the_seeds_its_rows_would_give():
    """A continued decode step's draw inputs come from the last step's columns
    (PlainDecode.continued, Sampler.continued_draw_inputs), not from its rows: the same
    temperatures and seeds as draw_inputs over its rows, one output position on, the seeded
    rows at their request's seed (of any size) and the others fresh from the generator."""
    params = [SamplingParams(seed=2**70), SamplingParams(temperature=0.7),
              SamplingParams(seed=-3, temperature=0.5)]
    rows = [ScheduledSequence(f"r{i}", [PLACEHOLDER_TOKEN], 10, (0,), True, p, (), (), 4 + i, i)
            for i, p in enumerate(params)]
    last = PlainDecode.of(1, rows, Sampler(0).draw_inputs(rows))
    src = np.array([2, 0, 1])
    plain = last.continued(2, src)
    temperature, seeds = Sampler(1).continued_draw_inputs(plain.temperature, plain.seeded,
                                                          plain.seeds, plain.num_outputs)
    next_rows = [ScheduledSequence(s.request_id, [PLACEHOLDER_TOKEN], 11, (0,), True, s.params,
                                   (), (), s.num_output_tokens + 1, int(i))
                 for i, s in zip(src, (rows[i] for i in src))]
    want_temperature, want_seeds = Sampler(1).draw_inputs(next_rows)
    assert temperature.tolist() == want_temperature.tolist()
    assert seeds.tolist() == want_seeds.tolist()
