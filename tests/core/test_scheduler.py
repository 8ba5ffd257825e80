"""Scheduler with a fake runner that keeps a real paged "KV cache" (fakes.FakeRunner): a wrong
block table, a block shared between different prefixes, a shared block overwritten, or a token
lost or repeated across preemption changes the output and fails the comparison."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch import RunnerOutput
from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.request import EOS_TOKEN_ID, Request, RequestStatus, SamplingParams
from engine.core.scheduler import Scheduler, check_fits
from engine.core.waiting import PriorityWaitingQueue
from fakes import FakeRunner, reference_output



def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, prefix=True, policy="fcfs"):
    bm = BlockManager(num_blocks, block_size, prefix)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      max_model_len=1024, scheduling_policy=policy), bm)
    return sched, bm, FakeRunner(num_blocks, block_size)


def run_to_completion(sched, bm, runner, max_steps=10_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        out = sched.schedule()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        assert len(out.sequences) <= sched.config.max_num_seqs
        for req in sched.update(out, runner.execute(out)):
            if req.status.is_finished:
                assert req.request_id not in finished, "finished twice"
                finished[req.request_id] = req
        bm.check_invariants()
        sched.check_invariants()
    raise AssertionError("did not finish")


def add(sched, rid, prompt, max_tokens, priority=0, arrival_time=None):
    arrival = {} if arrival_time is None else {"arrival_time": arrival_time}
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  priority=priority, **arrival)
    sched.add(req)
    return req


def test_decodes_and_prefill_chunks_share_a_step():
    sched, bm, runner = make(budget=6)
    add(sched, "a", [1, 2], 5)
    first = sched.schedule()
    sched.update(first, runner.execute(first))
    add(sched, "b", list(range(20)), 3)
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in out.sequences] == [
        ("a", 1, True), ("b", 5, False)]


def test_outputs_match_reference_with_tiny_chunks():
    sched, bm, runner = make(budget=7)
    reqs = [add(sched, f"r{i}", [i + 1] * (3 + 11 * i), 9) for i in range(5)]
    run_to_completion(sched, bm, runner)
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, 9)
        assert req.finish_reason == "length"
    assert bm.num_free_blocks == bm.num_blocks


def test_preemption_recomputes_without_losing_tokens():
    sched, bm, runner = make(num_blocks=12, block_size=4, budget=32)
    reqs = [add(sched, f"r{i}", list(range(i, i + 10)), 20) for i in range(4)]
    run_to_completion(sched, bm, runner)
    assert sched.num_preemptions > 0
    for req in reqs:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, 20)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


def test_prefix_hit_skips_cached_tokens_and_shares_blocks():
    sched, bm, runner = make(block_size=4)
    shared = list(range(40))
    add(sched, "a", shared + [1], 2)
    run_to_completion(sched, bm, runner)
    b = add(sched, "b", shared + [2], 2)
    out = sched.schedule()
    assert out.sequences[0].start_position == 40 and b.num_cached_tokens == 40
    assert bm.prefix_hits == 40


def test_prefix_hits_stay_within_a_cache_salt():
    """Same prompt, three tenants: only the tenant whose request cached the prefix hits it,
    and every output still matches the reference (no KV crossed tenants)."""
    sched, bm, runner = make(block_size=4)
    shared = list(range(40))
    first = Request("a", shared + [1], SamplingParams(max_tokens=2), cache_salt="t1")
    sched.add(first)
    run_to_completion(sched, bm, runner)
    later = [Request(rid, shared + [2], SamplingParams(max_tokens=2), cache_salt=salt)
             for rid, salt in [("other", "t2"), ("none", None), ("same", "t1")]]
    for req in later:
        sched.add(req)
    run_to_completion(sched, bm, runner)
    assert [req.num_cached_tokens for req in later] == [0, 0, 40]
    for req in [first, *later]:
        assert req.output_token_ids == reference_output(req.prompt_token_ids, 2)


def test_abort_frees_blocks_and_stops_scheduling():
    sched, bm, runner = make()
    add(sched, "a", list(range(30)), 50)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.finish("a", RequestStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.schedule().is_empty
    bm.check_invariants()


def test_eos_and_stop_token_ids_finish_requests():
    sched, bm, runner = make()
    req = Request("a", [5], SamplingParams(max_tokens=50, stop_token_ids=(
        reference_output([5], 3)[2],)))
    sched.add(req)
    run_to_completion(sched, bm, runner)
    assert req.finish_reason == "stop" and len(req.output_token_ids) == 3


def test_stop_tokens_wait_for_min_tokens_and_eos_follows_ignore_eos():
    assert SamplingParams(stop_token_ids=(7,)).stop_token_set == {7, EOS_TOKEN_ID}
    assert SamplingParams(ignore_eos=True, stop_token_ids=(7,)).stop_token_set == {7}
    sched, bm, runner = make()
    first = reference_output([5], 1)[0]
    req = Request("a", [5], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(first,)))
    sched.add(req)
    run_to_completion(sched, bm, runner)
    assert req.output_token_ids[0] == first and len(req.output_token_ids) > 1


def test_rejects_requests_over_context_or_pool():
    sched, _, _ = make(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        add(sched, "a", [1] * 1000, 100)
    with pytest.raises(ValueError, match="pool"):
        add(sched, "b", [1] * 10, 10)
    with pytest.raises(ValueError, match="empty"):
        add(sched, "c", [], 1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(8, 40),
       block_size=st.sampled_from([1, 2, 4, 8]), budget=st.integers(1, 40),
       max_seqs=st.integers(1, 6), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_random_workloads(seed, num_blocks, block_size, budget, max_seqs, prefix, policy):
    """Under either policy (random priorities, ties included): every output matches the
    reference through preemptions and aborts, the queues stay consistent and in the
    policy's order, and nothing starves."""
    rng = random.Random(seed)
    sched, bm, runner = make(num_blocks, block_size, budget, max_seqs, prefix, policy)
    capacity = num_blocks * block_size
    expected, aborted, finished = {}, set(), {}
    for step in range(400):
        if step < 40 and rng.random() < 0.4:  # arrivals; prompts often share a prefix
            # tokens from a tiny alphabet: equal blocks at different positions are common
            prompt = [1, 2, 3, 4, 5, 6][:rng.randint(0, 6)] + [rng.randrange(3)
                                                              for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, max(1, min(12, capacity - len(prompt))))
            if len(prompt) + max_tokens <= capacity:
                add(sched, f"r{step}", prompt, max_tokens, priority=rng.randint(-2, 2),
                    arrival_time=float(rng.randint(0, 20)))
                expected[f"r{step}"] = reference_output(prompt, max_tokens)
        if sched.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(sched.requests))
            sched.finish(rid, RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        out = sched.schedule()
        for req in sched.update(out, runner.execute(out)):
            if req.status.is_finished:
                assert req.request_id not in finished
                finished[req.request_id] = req
        bm.check_invariants()
        sched.check_invariants()
        if step >= 40 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "requests starved"
    assert set(finished) | aborted == set(expected)
    for rid, req in finished.items():
        assert req.output_token_ids == expected[rid]
        assert_counts_match_tokens(req)
    assert bm.num_free_blocks == num_blocks


def assert_counts_match_tokens(req: Request) -> None:
    """The cached counts of Request must follow its token lists."""
    assert req.num_output_tokens == len(req.output_token_ids)
    assert req.num_tokens == len(req.prompt_token_ids) + len(req.output_token_ids)


def test_request_counts_follow_appended_tokens():
    req = Request("r", [1, 2, 3], SamplingParams(), output_token_ids=[4])
    assert_counts_match_tokens(req)
    req.append_output_token(5)
    assert_counts_match_tokens(req)
    assert req.all_token_ids == [1, 2, 3, 4, 5]


def test_aborting_100k_queued_requests_is_fast_and_keeps_order():
    """An abort must not scan the queue: 100k queued aborts took minutes when it did."""
    import time as clock

    scheduler = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4,
                                          max_num_batched_tokens=64), BlockManager(64, 4))
    count = 100_000
    for i in range(count):
        scheduler.add(Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4)))
    start = clock.perf_counter()
    for i in range(0, count, 2):
        scheduler.finish(str(i), RequestStatus.FINISHED_ABORTED)
    assert clock.perf_counter() - start < 1.0
    assert len(scheduler.waiting) == count // 2
    assert [r.request_id for r in scheduler.waiting][:3] == ["1", "3", "5"]
    scheduler.schedule()  # admits from the front, in order
    assert [r.request_id for r in scheduler.running] == ["1", "3", "5", "7"]


def test_fit_rule_states_the_numbers():
    check_fits(1000, 24, max_model_len=1024, pool_tokens=1024)  # exactly full is fine
    with pytest.raises(ValueError, match="maximum context length is 1024") as info:
        check_fits(1000, 25, max_model_len=1024, pool_tokens=4096)
    assert "1025 tokens" in str(info.value) and "1000 in the prompt" in str(info.value)
    with pytest.raises(ValueError, match="the whole pool holds 640"):
        check_fits(600, 41, max_model_len=1024, pool_tokens=640)
    with pytest.raises(ValueError, match="prompt is empty"):
        check_fits(0, 1, max_model_len=1024, pool_tokens=640)


@pytest.mark.parametrize("num_blocks", [8, 3], ids=["lookahead", "no-room"])
def test_a_draft_model_request_keeps_k_positions_of_lookahead(num_blocks):
    """With a draft model, a verifying request's table covers k positions past its tokens
    (the draft writes there when it drafts the next step ahead), kept through the shrink
    after the verification; where the pool has no room for them, the step runs without
    them and nothing is preempted."""
    from engine.speculative.draft_slots import DraftSlots
    from engine.speculative.speculator import Speculator

    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=1024), bm,
                      speculator=Speculator(DraftSlots(), 4, 1024, lookahead=4))
    add(sched, "a", list(range(6)), 6)
    prefill = sched.schedule()
    sched.update(prefill, RunnerOutput(["a"], [6], [None]))
    verification = sched.schedule()  # t6 @6 and 4 draft slots: positions 6..10
    (seq,) = verification.sequences
    assert seq.num_drafts == 4 and not sched.num_preemptions
    room = num_blocks * 4 >= 15
    assert len(bm.block_ids("a")) == (4 if room else 3)  # 11 tokens, + 4 of lookahead
    sched.update(verification, RunnerOutput(["a"], [9], [None], [[7]]))  # 1 accepted
    assert sched.running[0].num_computed_tokens == 8
    assert len(bm.block_ids("a")) == 3  # 8 computed + 4 of lookahead, or cut to the 3 held
    bm.check_invariants()


def test_priority_admits_a_later_urgent_request_before_earlier_ones():
    """Under the priority policy the waiting queue is ordered by (priority, arrival): a
    request arriving last with a lower priority value is admitted first, then the rest by
    priority and, within one priority, by arrival. Under fcfs, arrival order alone."""
    arrivals = [("early-low", 5), ("mid-low", 5), ("middling", 1), ("late-urgent", -3)]
    for policy, expected in (("priority", ["late-urgent", "middling", "early-low", "mid-low"]),
                             ("fcfs", ["early-low", "mid-low", "middling", "late-urgent"])):
        sched, _, runner = make(max_seqs=1, policy=policy)
        for arrival, (rid, priority) in enumerate(arrivals):
            add(sched, rid, [1, 2, 3], 2, priority=priority, arrival_time=float(arrival))
        admitted = []
        while sched.has_unfinished():
            out = sched.schedule()
            admitted += [s.request_id for s in out.sequences if s.start_position == 0]
            sched.update(out, runner.execute(out))
            sched.check_invariants()
        assert admitted == expected, policy


def test_priority_preempts_the_worst_running_request_first():
    """Out of blocks, the running request with the worst (priority, arrival) is preempted,
    not the newest: here the one admitted first; the urgent ones keep their blocks."""
    sched, bm, runner = make(num_blocks=6, block_size=4, budget=64, policy="priority")
    low = add(sched, "low", list(range(8)), 12, priority=9, arrival_time=0.0)
    out = sched.schedule()  # low alone: admitted before the others arrive
    sched.update(out, runner.execute(out))
    urgent = [add(sched, f"urgent{i}", list(range(10 + i, 14 + i)), 8, priority=0,
                  arrival_time=1.0 + i) for i in range(2)]
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert [r.request_id for r in sched.running] == ["urgent0", "urgent1", "low"]
    while not sched.num_preemptions:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        sched.check_invariants()
    assert low.num_preemptions == 1 and all(r.num_preemptions == 0 for r in urgent)
    run_to_completion(sched, bm, runner)
    for req in [low, *urgent]:
        assert req.output_token_ids == reference_output(req.prompt_token_ids,
                                                        req.params.max_tokens)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["push", "pop", "remove"]),
                              st.integers(0, 7), st.integers(-2, 2), st.integers(0, 3)),
                    max_size=120))
def test_priority_queue_pops_in_key_order_through_removals_and_reused_ids(ops):
    """Against a sorted-list model: pops come in (priority, arrival, push order) order,
    whatever was removed before, and an id removed then reused never revives its old entry."""
    queue, model, serial = PriorityWaitingQueue(), [], 0
    for op, rid_num, priority, arrival in ops:
        rid = f"r{rid_num}"
        if op == "push" and rid not in {r.request_id for _, r in model}:
            req = Request(rid, [1], SamplingParams(), arrival_time=float(arrival),
                          priority=priority)
            queue.append(req)
            model.append(((priority, float(arrival), serial), req))
            serial += 1
        elif op == "pop" and model:
            model.sort(key=lambda entry: entry[0])
            assert queue.popleft() is model.pop(0)[1]
        elif op == "remove" and any(r.request_id == rid for _, r in model):
            queue.remove(rid)
            model = [entry for entry in model if entry[1].request_id != rid]
        assert len(queue) == len(model)
        assert list(queue) == [r for _, r in sorted(model, key=lambda entry: entry[0])]
