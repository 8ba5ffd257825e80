"""Structured outputs through the offline LLM on a random GPT-2: whatever the model prefers,
every output parses and satisfies its constraint, greedy and sampled, with async scheduling
on and off, beside unconstrained requests that it must not change."""
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.batch import GrammarMask, ScheduledSequence
from engine.structured.manager import StructuredOutputs
from engine.structured.process import GrammarProcess
from engine.worker.sampler import apply_grammar_mask

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
PROMPTS = ["Hello", "The answer is", "Q: is it?", "{", "x" * 20, "1 2 3"]
MAX_TOKENS = 200  # whitespace runs are capped, so the schema above ends well before this


def make_llm(checkpoint, **overrides):
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=256, attention_backend="torch")
    settings.update(overrides)
    return LLM(model=str(checkpoint), **settings)


ENGINES = {"async": dict(async_scheduling=True), "sync": dict(async_scheduling=False),
           # the grammars in their child process, as CUDA engines have them
           "process": dict(async_scheduling=True),
           # CUDA graphs, the Triton kernels and the masked draw on the device
           "cuda": dict(device="cuda", dtype="float16", attention_backend="auto")}


@pytest.fixture(scope="module", params=[
    "async", "sync", "process", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def llm(request, tiny_checkpoint):
    llm = make_llm(tiny_checkpoint, **ENGINES[request.param])
    if request.param == "process":
        core = llm.engine.core
        core.grammars = GrammarProcess(core.config.scheduler.max_num_seqs, num_children=2)
        yield llm
        core.grammars.close()
    else:
        yield llm


def generate(llm, spec, temperature, seed=None, prompts=PROMPTS, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                            structured_outputs=spec, **kw)
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2), (1.5, 3)])
def test_json_schema_outputs_parse_and_validate(llm, temperature, seed):
    for [choice] in generate(llm, StructuredOutputsParams(json=SCHEMA), temperature, seed):
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert choice.finish_reason == "stop"


def test_the_sampler_s_full_path_masks_too(llm):
    """Top-k, a penalty and logprobs take the sampler's full path, not the masked draw."""
    for [choice] in generate(llm, StructuredOutputsParams(json=SCHEMA), 1.0, 12, top_k=50,
                             presence_penalty=0.5, logprobs=2):
        jsonschema.validate(json.loads(choice.text), SCHEMA)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 4), (1.0, 5)])
def test_regex_and_choice_outputs_match(llm, temperature, seed):
    pattern = r"\d{3}-[a-z]{2,4}"
    for [choice] in generate(llm, StructuredOutputsParams(regex=pattern), temperature, seed):
        assert re.fullmatch(pattern, choice.text), choice.text
    options = ["red", "green", "blue light"]
    for [choice] in generate(llm, StructuredOutputsParams(choice=options), temperature, seed):
        assert choice.text in options


def test_ebnf_grammar_and_json_object(llm):
    grammar = 'root ::= "(" [a-c]+ ")" | "none"'
    for [choice] in generate(llm, StructuredOutputsParams(grammar=grammar), 1.0, seed=6):
        assert re.fullmatch(r"\([a-c]+\)|none", choice.text), choice.text
    for [choice] in generate(llm, StructuredOutputsParams(json_object=True), 0.8, seed=7):
        if choice.finish_reason == "stop":  # an object may be cut by max_tokens
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{")


def test_n_choices_stop_strings_and_max_tokens_keep_working(llm):
    spec = StructuredOutputsParams(json=SCHEMA)
    [choices] = generate(llm, spec, 1.0, seed=8, prompts=["Hi"], n=3)
    assert len(choices) == 3
    for choice in choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    [[cut]] = generate(llm, spec, 0.0, prompts=["Hi"], stop=['"n"'])
    assert cut.finish_reason == "stop" and '"n"' not in cut.text and cut.text.startswith("{")
    short = llm.generate(["Hi"], SamplingParams(max_tokens=3, temperature=0.0,
                                                structured_outputs=spec), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "length"
    assert len(short[0].outputs[0].token_ids) == 3


def test_seeded_constrained_sampling_is_reproducible(llm):
    spec = StructuredOutputsParams(regex=r"[a-z]{5,12}")
    assert generate(llm, spec, 1.0, seed=9) == generate(llm, spec, 1.0, seed=9)


def test_a_complete_constraint_ends_the_request_even_with_ignore_eos(llm):
    [[choice]] = generate(llm, StructuredOutputsParams(choice=["yes", "no"]), 1.0, seed=10,
                          prompts=["?"], ignore_eos=True)
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [constrained] * len(PROMPTS),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]] == \
        [o.outputs[0].token_ids for o in alone]
    for out in mixed[len(PROMPTS):]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_a_spec_that_cannot_compile_is_refused_before_the_engine(llm):
    for spec, words in [(StructuredOutputsParams(regex="(ab"), "regex"),
                        (StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
                        (StructuredOutputsParams(grammar="root ::= nothere"), "nothere")]:
        with pytest.raises(ValueError, match=words):
            llm.generate(["x"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])


def test_equal_specs_share_one_compile():
    grammars = StructuredOutputs(max_rows=3)
    schema = dict(SCHEMA, title="shared")
    for seq_id, spec in [("a", StructuredOutputsParams(json=schema)),
                         ("b", StructuredOutputsParams(json=schema)),
                         ("c", StructuredOutputsParams(json=json.dumps(schema, sort_keys=True)))]:
        grammars.submit(seq_id, spec)
    ready = []
    while len(ready) < 3:
        ready += grammars.take_compiled(timeout=1.0)
    assert sorted(ready) == [("a", None), ("b", None), ("c", None)]
    assert grammars.num_compiles == 1


def test_the_sampler_masks_exactly_the_disallowed_tokens():
    vocab = 100
    rng = np.random.default_rng(0)
    allowed = rng.random((2, vocab)) < 0.2
    words = np.zeros((2, -(-vocab // 32) + 1), np.int64)  # a spare word: masks may be wider
    for row, col in zip(*np.nonzero(allowed)):
        words[row, col // 32] |= 1 << (col % 32)
    bitmask = words.astype(np.uint32).view(np.int32)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    seqs = [ScheduledSequence(name, [1], 0, (0,), True, p) for name, p in
            [("a", params), ("free", SamplingParams()), ("b", params)]]
    logits = torch.randn(3, vocab)
    masked = apply_grammar_mask(logits.clone(), seqs, GrammarMask(["a", "b"], bitmask))
    assert torch.equal(torch.isinf(masked[[0, 2]]), torch.from_numpy(~allowed))
    assert torch.equal(masked[1], logits[1])
    with pytest.raises(ValueError, match="does not match"):
        apply_grammar_mask(logits.clone(), seqs, GrammarMask(["b", "a"], bitmask))


def test_preempted_rows_tokens_never_reach_their_grammar(tiny_checkpoint):
    """Async scheduling in a cache too small for every request: a preempted request's token
    still in flight is dropped, so its grammar must not take it (the grammars take a step's
    tokens before the step's update). Every output still matches its regex, whose length a
    matcher that took an extra token would cut short."""
    llm = make_llm(tiny_checkpoint, async_scheduling=True, num_kv_blocks=32, block_size=4,
                   max_num_seqs=16)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"))
    outs = llm.generate(PROMPTS * 3, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert re.fullmatch("[a-z]{40}", out.outputs[0].text), out.outputs[0].text
