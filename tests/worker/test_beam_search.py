"""Beam search (engine/core/beam.py) through the offline LLM on CPU, against transformers'
greedy beam search (`generate(num_beams=B, ...)`) on the same random weights: a tiny GPT-2
whose candidates rarely come within float32 noise of each other and whose beams often end by
EOS, so that the length penalty and the early-stopping rules decide between hypotheses of
different lengths (tests/peaky_checkpoint.py). And how a search runs in the engine: one decode
step per token, beside ordinary requests, in steps that replay."""
import pickle
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.beam_search import BeamSearchParams, beam_sequences
from engine.build import build_runner
from engine.core.request import EOS_TOKEN_ID
from engine.worker.inputs import is_decode_step
from fakes import RecordingRunner
from peaky_checkpoint import make_peaky_checkpoint

MAX_TOKENS = 12
PROMPT_LENGTHS = [1, 5, 17, 40]
# (length_penalty, early_stopping)
VARIANTS = [(1.0, False), (1.0, True), (1.0, "never"), (0.0, False), (2.0, False),
            (2.0, "never"), (-1.0, False), (0.5, True)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's ops are too small to split: a second thread only waits for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def peaky_checkpoint(tmp_path_factory):
    return make_peaky_checkpoint(tmp_path_factory.mktemp("peaky-gpt2"))


@pytest.fixture(scope="module")
def llm(peaky_checkpoint):
    return LLM(model=str(peaky_checkpoint), device="cpu", dtype="float32", num_kv_blocks=512,
               attention_backend="torch")


@pytest.fixture(scope="module")
def hf_model(peaky_checkpoint):
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(peaky_checkpoint, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(EOS_TOKEN_ID) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_beam_search(model, prompt, beam_width, length_penalty, early_stopping):
    """transformers' B best beams (generated tokens, EOS padded) and their scores."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         num_beams=beam_width, num_return_sequences=beam_width,
                         max_new_tokens=MAX_TOKENS, length_penalty=length_penalty,
                         early_stopping=early_stopping, pad_token_id=EOS_TOKEN_ID,
                         return_dict_in_generate=True, output_scores=True)
    return [row[len(prompt):].tolist() for row in out.sequences], out.sequences_scores.tolist()


def beam_params(beam_width, length_penalty, early_stopping, **extra):
    return BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS,
                            length_penalty=length_penalty, early_stopping=early_stopping,
                            **extra)


@pytest.mark.parametrize("length_penalty,early_stopping", VARIANTS)
@pytest.mark.parametrize("beam_width", [2, 4])
def test_greedy_beam_search_equals_transformers(llm, hf_model, prompts, beam_width,
                                                length_penalty, early_stopping):
    params = beam_params(beam_width, length_penalty, early_stopping,
                         include_stop_str_in_output=True)  # HF's sequences keep their EOS
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs):
        theirs, their_scores = hf_beam_search(hf_model, prompt, beam_width, length_penalty,
                                              early_stopping)
        ours = [seq.output_token_ids for seq in output.sequences]
        padded = [tokens + [EOS_TOKEN_ID] * (len(hf) - len(tokens))
                  for tokens, hf in zip(ours, theirs)]
        assert padded == theirs and len(ours) == beam_width, f"prompt of {len(prompt)}"
        scores = [seq.cum_logprob / len(tokens) ** length_penalty
                  for seq, tokens in zip(output.sequences, ours)]
        assert scores == pytest.approx(their_scores, rel=1e-4, abs=1e-4)
        for seq, tokens in zip(output.sequences, ours):
            assert seq.tokens == prompt + tokens
            assert seq.finish_reason == ("stop" if tokens[-1] == EOS_TOKEN_ID else "length")
            assert len(seq.logprobs) == len(tokens)
            assert seq.cum_logprob == pytest.approx(sum(e.token_logprob for e in seq.logprobs))


def test_the_variants_change_the_result(llm, prompts):
    """The comparisons above test the length penalty and each early_stopping rule only if
    they change what the search returns."""
    def tokens(length_penalty, early_stopping):
        outputs = llm.beam_search(prompts, beam_params(2, length_penalty, early_stopping))
        return [[seq.tokens for seq in out.sequences] for out in outputs]

    rules = [tokens(1.0, early_stopping) for early_stopping in (False, True, "never")]
    penalties = [tokens(length_penalty, False) for length_penalty in (0.0, 1.0, 2.0)]
    for results in (rules, penalties):
        assert len({str(result) for result in results}) == 3
    ends = {seq.finish_reason for out in llm.beam_search(prompts, beam_params(4, 1.0, False))
            for seq in out.sequences}
    assert ends == {"stop", "length"}


def test_eos_is_left_out_of_tokens_and_text_unless_asked_for(llm, prompts):
    plain = llm.beam_search(prompts, beam_params(4, 1.0, False))
    kept = llm.beam_search(prompts, beam_params(4, 1.0, False, include_stop_str_in_output=True))
    decode = llm.engine.tokenizer.decode
    stopped = 0
    for out_plain, out_kept in zip(plain, kept):
        for seq, seq_kept in zip(out_plain.sequences, out_kept.sequences):
            assert seq.text == seq_kept.text == decode(seq.tokens)  # the prompt's text first
            if seq.finish_reason == "stop":
                stopped += 1
                assert seq.stop_reason == EOS_TOKEN_ID
                assert seq_kept.tokens == seq.tokens + [EOS_TOKEN_ID]
                assert len(seq.logprobs) == len(seq.output_token_ids) + 1
            else:
                assert seq_kept.tokens == seq.tokens and seq.stop_reason is None
    assert stopped > 0


def test_ignore_eos_extends_beams_through_eos(llm, prompts):
    outputs = llm.beam_search(prompts, beam_params(4, 1.0, False, ignore_eos=True))
    sequences = [seq for out in outputs for seq in out.sequences]
    assert all(seq.finish_reason == "length" and len(seq.output_token_ids) == MAX_TOKENS
               for seq in sequences)
    assert any(EOS_TOKEN_ID in seq.output_token_ids for seq in sequences)


@pytest.fixture
def recorder(llm):
    core = llm.engine.core
    recorder = RecordingRunner(core.runner)
    core.runner = recorder
    yield recorder
    core.runner = recorder.runner


def test_a_search_step_is_one_decode_step_of_its_live_beams(llm, recorder):
    """After the prompt's prefill, each step computes one token per live beam, as a decode
    step (a graph replay on CUDA); nothing is prefilled again. The first fan-out shares the
    prompt's full blocks and copies its partial one into each fork."""
    block_size = llm.engine.config.cache.block_size
    prompt = [random.Random(5).randrange(EOS_TOKEN_ID) for _ in range(2 * block_size + 9)]
    llm.beam_search([prompt], beam_params(4, 1.0, "never", ignore_eos=True))
    steps = [pickle.loads(raw) for raw in recorder.steps]
    assert len(steps) == MAX_TOKENS
    assert [len(s.token_ids) for s in steps[0].sequences] == [len(prompt)]
    for k, step in enumerate(steps[1:]):
        assert is_decode_step(step.sequences) and len(step.sequences) == 4
        assert {s.start_position for s in step.sequences} == {len(prompt) + k}
    first = steps[1].sequences
    assert len({s.block_ids[:2] for s in first}) == 1
    assert len(steps[1].block_copies) == 3
    assert {dst for _, dst in steps[1].block_copies} == {s.block_ids[2] for s in first[1:]}
    assert all(output.logprobs[0] is not None and len(output.logprobs[0].top_token_ids) == 8
               for output in recorder.outputs)
    manager = llm.engine.block_manager
    manager.check_invariants()
    assert manager.num_free_blocks == manager.num_blocks


def test_ordinary_requests_batched_with_searches_are_unaffected(llm, prompts):
    """Greedy, seeded and logprobs requests give the same tokens alone and in the steps of
    running searches; the searches give what they give alone."""
    ordinary = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
                SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2,
                               ignore_eos=True)]
    params = beam_params(4, 1.0, False)
    alone = llm.generate(prompts[:3], ordinary, use_tqdm=False)
    searched = llm.beam_search(prompts, params)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_beam_search(f"beam{i}", prompt, params)
    for i, (prompt, sampling) in enumerate(zip(prompts, ordinary)):
        engine.add_request(f"plain{i}", prompt, sampling)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    for i, out in enumerate(alone):
        assert finals[f"plain{i}"].outputs[0].token_ids == out.outputs[0].token_ids
    for i, out in enumerate(searched):
        together = beam_sequences(finals[f"beam{i}"], params)
        assert [s.tokens for s in together] == [s.tokens for s in out.sequences]


def test_recorded_beam_steps_replay_through_a_fresh_runner(peaky_checkpoint, prompts):
    """A step carries all a search needs, block copies included: searches and ordinary
    requests recorded with async scheduling replay through a fresh runner to the same
    tokens and logprobs."""
    llm = LLM(model=str(peaky_checkpoint), device="cpu", dtype="float32", num_kv_blocks=128,
              attention_backend="torch", async_scheduling=True)
    recorder = RecordingRunner(llm.engine.core.runner)
    llm.engine.core.runner = recorder
    llm.beam_search(prompts, beam_params(3, 1.0, False))
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    steps = [pickle.loads(raw) for raw in recorder.steps]
    assert sum(len(step.block_copies) for step in steps) > 4
    fresh = build_runner(llm.engine.config)
    assert [fresh.execute(step) for step in steps] == recorder.outputs


def test_temperature_does_not_change_the_beams(llm, prompts):
    """Candidates are each beam's top 2B raw logprobs, whatever a step would sample."""
    def tokens(temperature):
        params = beam_params(4, 1.0, False, temperature=temperature)
        return [[seq.tokens for seq in out.sequences] for out in llm.beam_search(prompts, params)]

    assert tokens(1.5) == tokens(0.0)


def test_batched_prompts_search_independently(llm, prompts):
    params = beam_params(2, 1.0, False)
    together = llm.beam_search(prompts, params)
    alone = [llm.beam_search(prompt, params)[0] for prompt in prompts]
    assert [[s.tokens for s in o.sequences] for o in together] == \
        [[s.tokens for s in o.sequences] for o in alone]


def test_bad_params_and_prompts_are_value_errors(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)  # 22 logprobs: more than the engine's 20
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    too_long = BeamSearchParams(beam_width=2, max_tokens=llm.engine.config.scheduler.max_model_len)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.beam_search([[1, 2, 3]], too_long)
