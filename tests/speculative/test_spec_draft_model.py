"""Draft-model speculation in the engine (CPU, tiny random GPT-2s): output token for token the
same as without it, for a draft that is the target itself (it accepts nearly every draft) and
for a smaller random draft (it accepts almost none), greedy in mixed batches with prefix
caching, 7-token chunks, preemption and either scheduling mode, and seeded-sampled; the draft's
KV in prefix-cached blocks; one-line config errors; the counters; the server."""
import json
import shutil

import httpx
import torch
import pytest

from engine import SamplingParams
from engine.core.config import ConfigError
from engine.worker.models.random_checkpoint import make_checkpoint
from server_harness import ServerProcess, metric, serve
from spec_cases import EACH_SETTING, GREEDY, K, assert_all_blocks_free, make_llm, mixed_params


@pytest.fixture(scope="session")
def small_draft(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("draft-gpt2"), n_layer=1, n_embd=32,
                           n_head=2, seed=1)


@pytest.fixture(params=["target", "small"])
def draft(request, tiny_checkpoint, small_draft):
    """The target's own checkpoint (same weights: its greedy drafts are the target's
    tokens), or a smaller random draft."""
    return tiny_checkpoint if request.param == "target" else small_draft


def draft_config(draft, k=K):
    return {"model": str(draft), "num_speculative_tokens": k}


def check_acceptance(llm, draft, tiny_checkpoint, drafted_greedily=True):
    stats = llm.engine.core.speculator.stats
    assert stats.num_draft_tokens > 0
    if draft == tiny_checkpoint and drafted_greedily:
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens


@pytest.mark.slow
@EACH_SETTING
def test_draft_model_speculation_changes_no_greedy_token(tiny_checkpoint, draft, prompts,
                                                         plain_greedy, overrides):
    llm = make_llm(tiny_checkpoint, speculative_config=draft_config(draft), **overrides)
    outputs = llm.generate(prompts, mixed_params(prompts), use_tqdm=False)
    assert [o.token_ids for o in outputs] == plain_greedy
    check_acceptance(llm, draft, tiny_checkpoint)
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_seeded_sampled_requests_are_unchanged_by_a_draft_model(tiny_checkpoint, draft,
                                                               prompts, seeded):
    """The draft's guesses are its argmax (one-hot q): each is judged by the draw plain
    decoding makes at its position."""
    params, references = seeded
    llm = make_llm(tiny_checkpoint, speculative_config=draft_config(draft))
    got = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [o.token_ids for o in got] == references
    check_acceptance(llm, draft, tiny_checkpoint, drafted_greedily=False)
    assert_all_blocks_free(llm)


def test_prefix_cached_blocks_hold_the_drafts_kv_too(tiny_checkpoint, prompts):
    """A request that starts from blocks cached by an earlier one drafts from the draft KV
    written when they were computed: with the target as its own draft, it accepts nearly
    every draft (stale draft KV would not)."""
    prompt = prompts[2] + prompts[2][:7]
    expected = make_llm(tiny_checkpoint).generate([prompt], GREEDY, use_tqdm=False)[0]
    llm = make_llm(tiny_checkpoint, speculative_config=draft_config(tiny_checkpoint),
                   block_size=4)
    llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    stats, hits = llm.engine.core.speculator.stats, llm.engine.block_manager.prefix_hits
    drafted, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == expected.token_ids
    assert llm.engine.block_manager.prefix_hits > hits
    assert stats.num_accepted_tokens - accepted >= 0.9 * (stats.num_draft_tokens - drafted) > 0


def test_metrics_count_draft_model_speculation(tiny_checkpoint, prompts):
    llm = make_llm(tiny_checkpoint, speculative_config=draft_config(tiny_checkpoint))
    llm.generate(prompts, GREEDY, use_tqdm=False)
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert 0 < accepted <= metrics["vllm:spec_decode_num_draft_tokens"].value <= K * drafts
    assert len(per_pos) == K and sum(per_pos) == accepted


@pytest.fixture(scope="module")
def unfit_drafts(tmp_path_factory, tiny_checkpoint):
    """Copies of the tiny checkpoint whose config.json is changed: another vocabulary, and
    more layers than the target (the check reads config.json before any weight)."""
    drafts = {}
    for name, change in (("vocab", {"vocab_size": 50304}), ("larger", {"n_layer": 3})):
        path = tmp_path_factory.mktemp(f"draft-{name}")
        shutil.copytree(tiny_checkpoint, path, dirs_exist_ok=True)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **change}))
        drafts[name] = path
    return drafts


@pytest.mark.parametrize("name, message", [
    ("vocab", "speculative_config.model='vocab_size 50304': the draft's vocabulary must be "
              "the target's (50257)"),
    ("larger", "speculative_config.model='~"),
])
def test_unfit_drafts_fail_at_startup_in_one_line(tiny_checkpoint, unfit_drafts, name,
                                                  message):
    with pytest.raises(ConfigError) as err:
        make_llm(tiny_checkpoint, speculative_config=draft_config(unfit_drafts[name]))
    assert message in str(err.value) and "\n" not in str(err.value)
    if name == "larger":
        assert "must not be larger than the target" in str(err.value)


def test_a_draft_needs_k_of_at_least_one(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"^invalid config: "
                                          r"speculative_config\.num_speculative_tokens=0"):
        make_llm(tiny_checkpoint, speculative_config=draft_config(tiny_checkpoint, k=0))


def test_server_rejects_a_larger_draft_in_one_line(tiny_checkpoint, unfit_drafts):
    proc = serve("--model", str(tiny_checkpoint), "--speculative-config",
                 json.dumps(draft_config(unfit_drafts["larger"])))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "gpt2-serve: error: invalid config: speculative_config.model="), proc.stderr


def test_server_speculates_with_a_draft_model(tiny_checkpoint, tmp_path):
    server = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--num-kv-blocks", "64",
                           "--speculative-config", json.dumps(draft_config(tiny_checkpoint, 3)))
    try:
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": str(tiny_checkpoint.name), "prompt": list(range(100, 120)),
            "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        accepted = metric(server.url, "vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= metric(server.url, "vllm:spec_decode_num_draft_tokens_total")
    finally:
        server.stop()


def test_the_target_reads_the_drafts_from_the_device(tiny_checkpoint):
    """The scheduler reserves UNFILLED_DRAFT slots; the drafter returns a device tensor of
    its tokens, which the target's forward reads in those slots."""
    from engine.core.batch import UNFILLED_DRAFT

    engine = make_llm(tiny_checkpoint, speculative_config=draft_config(tiny_checkpoint)).engine
    runner, events = engine.runner, []
    drafter = runner.speculation.drafter
    fill, forward = drafter.fill, runner.model.forward
    drafter.fill = lambda seqs, *rest: events.append(
        ("fill", seqs, fill(seqs, *rest))) or events[-1][2]
    runner.model.forward = lambda ids, *a: events.append(("forward", ids.tolist())) or forward(
        ids, *a)
    engine.add_request("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=9))
    while engine.has_unfinished_requests():
        engine.step()
    verified = [(fill_event, forward_event) for fill_event, forward_event
                in zip(events, events[1:]) if fill_event[0] == "fill"]
    assert verified
    for (_, seqs, drafts), (_, input_ids) in verified:
        (seq,) = seqs
        assert seq.token_ids[-seq.num_drafts:] == [UNFILLED_DRAFT] * seq.num_drafts
        row = drafts[0].tolist()
        assert min(row[:seq.num_drafts]) >= 0
        assert input_ids[-seq.num_drafts:] == row[:seq.num_drafts]


class PausingSwitch:
    """A switch-off that turns drafting off every fourth step."""

    def __init__(self) -> None:
        self.steps = 0

    def choose(self, batch_size: int) -> int:
        self.steps += 1
        return 0 if self.steps % 4 == 0 else K

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        pass


@pytest.mark.parametrize("case", ["accepting", "rejecting", "sampled", "pausing",
                                  "near-max-len"])
def test_the_draft_has_kv_wherever_the_target_has(tiny_checkpoint, case):
    """Steps whose every sequence verifies drafts skip the draft's follow pass; the next
    step's run, queued right behind the verification, writes the one KV they left out (the
    last draft's, where all were accepted) and its drafts are taken. Drafting greedily with
    the target's own weights, every draft is accepted ("accepting"); "rejecting" corrupts fill
    i's draft i % (K + 1) - 1, so steps accept 1, 2, ..., K drafts in turn; "sampled" has the
    target sample (none accepted, tokens that differ); "pausing" drafts nothing every fourth
    step (drafts made ahead serve only the step after their verification: later they would
    be stale and rejected); "near-max-len" decodes to max_model_len 48, where a block table
    cannot cover the positions a run ahead writes, so those steps follow instead. Whatever
    was accepted, the draft's KV equals the target's at every position the request computed,
    and both pools are empty outside its blocks."""
    max_model_len, max_tokens = (48, 38) if case == "near-max-len" else (1024, 60)
    engine = make_llm(tiny_checkpoint, speculative_config=draft_config(tiny_checkpoint),
                      max_model_len=max_model_len).engine
    runner, drafter = engine.runner, engine.runner.speculation.drafter
    speculator, fills, fill = engine.core.speculator, [], drafter.fill

    def counting(seqs, *rest):
        fills.append(seqs)
        drafts, column = fill(seqs, *rest).clone(), len(fills) % (K + 1) - 1
        if case == "rejecting" and column >= 0:
            drafts[:, column] = (drafts[:, column] + 1) % 50257
        return drafts

    drafter.fill = counting
    if case == "pausing":
        speculator.switch = PausingSwitch()
    sampled = case == "sampled"
    engine.add_request("a", list(range(10)), SamplingParams(
        temperature=1.0 if sampled else 0.0, seed=3, max_tokens=max_tokens, ignore_eos=True))
    (request,) = engine.core.scheduler.running or engine.core.scheduler.waiting
    while request.num_computed_tokens < (44 if case == "near-max-len" else 40):
        assert not request.status.is_finished
        engine.step()
    stats = speculator.stats
    if case == "rejecting":
        assert 0 < stats.num_accepted_tokens_per_pos[K - 1] < stats.num_drafts
    elif not sampled:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    # every fill after the first took the drafts made ahead, but those after a pause or
    # after a step that followed
    if case in ("pausing", "near-max-len"):
        assert 0 < drafter.num_taken_ahead < len(fills) - 1
    else:
        assert drafter.num_taken_ahead == len(fills) - 1 > 5
    blocks = engine.core.block_manager.block_ids(request.request_id)
    positions = torch.arange(request.num_computed_tokens)
    block_size = runner.block_size
    others = torch.ones(runner.num_kv_blocks, dtype=torch.bool)
    others[list(blocks)] = False
    for (k, v), (draft_k, draft_v) in zip(runner.kv_caches, drafter.runner.kv_caches):
        index = (torch.tensor(blocks)[positions // block_size], positions % block_size)
        torch.testing.assert_close(draft_k[index], k[index], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft_v[index], v[index], atol=1e-4, rtol=1e-4)
        for cache in (k, v, draft_k, draft_v):
            assert not cache[others].any()
