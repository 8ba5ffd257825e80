"""End to end on CPU: greedy parity with HF transformers, prefix sharing, the offline API."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.request import EOS_TOKEN_ID
from engine.output import processor as output_processor
from engine.output.detokenize import TextStream

PROMPT_LENGTHS = [1, 5, 17, 64, 150, 300]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(50256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_checkpoint, prompts):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                             pad_token_id=50256)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def make_llm(checkpoint, **overrides):
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=256, attention_backend="torch")
    settings.update(overrides)
    return LLM(model=str(checkpoint), **settings)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


@pytest.mark.parametrize("overrides", [
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},
    {"num_kv_blocks": 80, "block_size": 4, "max_num_batched_tokens": 64},
    {"async_scheduling": False},
    {"async_scheduling": False, "num_kv_blocks": 80, "block_size": 4,
     "max_num_batched_tokens": 64},
], ids=["prefix-cache", "no-prefix-cache", "chunk-7", "preemption", "sync",
        "sync-preemption"])
def test_greedy_matches_transformers(tiny_checkpoint, prompts, hf_greedy, overrides):
    llm = make_llm(tiny_checkpoint, **overrides)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.finish_reason == "length" for o in outputs)
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_shared_prefix_hits_cache_shares_blocks_and_keeps_output(tiny_checkpoint):
    rng = random.Random(2)
    prefix = [rng.randrange(50256) for _ in range(200)]
    prompts = [prefix + [rng.randrange(50256) for _ in range(5)] for _ in range(4)]
    uncached = make_llm(tiny_checkpoint, enable_prefix_caching=False)
    expected = [o.token_ids for o in uncached.generate(prompts, GREEDY, use_tqdm=False)]

    llm = make_llm(tiny_checkpoint)
    engine = llm.engine
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warm the cache with one request
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"p{i}", prompt, GREEDY)
    engine.step()  # admits all three: their tables exist now
    tables = [engine.block_manager.block_ids(f"p{i}#0") for i in range(3)]
    full_blocks = 200 // 16
    assert tables[0][:full_blocks] == tables[1][:full_blocks] == tables[2][:full_blocks]
    assert engine.block_manager.prefix_hits == 3 * full_blocks * 16
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o for o in engine.step() if o.finished})
    assert [results[f"p{i}"].token_ids for i in range(3)] == expected[1:]


def test_float32_logits_match_transformers(tiny_checkpoint, prompts):
    from transformers import GPT2LMHeadModel

    from engine.core.batch import ScheduledSequence, SchedulerOutput
    from runner_logits import logits_at_samples

    hf = GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()
    llm = make_llm(tiny_checkpoint)
    runner = llm.engine.runner
    prompt = prompts[4]
    blocks = list(range(-(-len(prompt) // 16)))
    seq = ScheduledSequence("x", prompt, 0, blocks, True, GREEDY)
    ours = logits_at_samples(runner, SchedulerOutput([seq]))[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, -1]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_text_prompts_stop_strings_and_n(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    sampled = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7)
    first, second = llm.generate(["Hello there", "Hello there"], sampled, use_tqdm=False)
    assert len(first.outputs) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # choices differ
    greedy = llm.generate("Hello there", GREEDY, use_tqdm=False)[0]
    stop = greedy.text[len(greedy.text) // 2:][:3]
    if stop:
        # EOS kept out by a bias, not by min_tokens: stop strings wait for min_tokens
        no_eos = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=(stop,),
                                logit_bias={EOS_TOKEN_ID: -100.0})
        cut = llm.generate("Hello there", no_eos, use_tqdm=False)[0]
        assert cut.finish_reason == "stop" and stop not in cut.text
        assert greedy.text.startswith(cut.text)


def test_seeded_request_draws_the_same_tokens_alone_in_a_crowd_and_preempted(
        tiny_checkpoint, prompts):
    """Its noise depends on (seed, position) only: neither its batch nor which sampler path
    drew (the crowd holds top-k rows, which send whole steps through the torch stages), nor
    recomputation after preemption (a small pool), nor the engine seed changes a token."""
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = make_llm(tiny_checkpoint).generate([prompts[3]], seeded, use_tqdm=False)
    crowd = [SamplingParams(top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True),
             SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, ignore_eos=True)]
    llm = make_llm(tiny_checkpoint, num_kv_blocks=80, block_size=4, max_num_batched_tokens=64,
                   seed=9)
    batch = [prompts[3]] + prompts[:3] + prompts[4:]
    params = [seeded] + [crowd[i % 2] for i in range(len(batch) - 1)]
    together = llm.generate(batch, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert together[0].token_ids == alone[0].token_ids
    assert len(set(alone[0].token_ids)) > 1


def test_bad_requests_are_rejected_and_engine_goes_on(tiny_checkpoint):
    llm = make_llm(tiny_checkpoint)
    engine = llm.engine
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        engine.add_request("long", [1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [50257], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", SamplingParams())
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_abort_frees_everything(tiny_checkpoint):
    engine = make_llm(tiny_checkpoint).engine
    engine.add_request("a", list(range(100)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("a")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.step() == []


def test_failure_in_one_request_ends_it_with_an_error_and_spares_the_others(tiny_checkpoint,
                                                                           monkeypatch):
    engine = make_llm(tiny_checkpoint).engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    class ExplodingStream(TextStream):
        def add(self, token_id, final):
            raise RuntimeError("detokenizer exploded")

    with monkeypatch.context() as patch:  # only "bad"'s choice gets the exploding stream
        patch.setattr(output_processor, "TextStream", ExplodingStream)
        engine.add_request("bad", [1, 2, 3], params)
    engine.add_request("good", [4, 5, 6], params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert "RuntimeError: detokenizer exploded" in finals["bad"].error
    assert finals["bad"].finish_reason == "abort"
    assert finals["good"].error is None and len(finals["good"].token_ids) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_kv_usage_matches_blocks_written(tiny_checkpoint, async_scheduling):
    """Mid-generation, the blocks the block manager reports in use are exactly the blocks whose
    KV slots hold data (the cache starts zeroed; no prefix cache keeps freed blocks' data)."""
    llm = make_llm(tiny_checkpoint, enable_prefix_caching=False, block_size=8,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    for i, n in enumerate([5, 17, 30]):
        engine.add_request(str(i), list(range(1, n + 1)),
                           SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(12):
        engine.step()
    bm = engine.block_manager
    held = [b for r in engine.scheduler.running for b in bm.block_ids(r.request_id)]
    for k_cache, v_cache in engine.runner.kv_caches:
        for cache in (k_cache, v_cache):
            written = torch.nonzero(cache.abs().sum(dim=(1, 2, 3))).flatten().tolist()
            assert sorted(held) == written
    assert round(bm.usage * bm.num_blocks) == len(held) == len(set(held))
