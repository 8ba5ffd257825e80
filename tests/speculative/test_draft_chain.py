"""The draft's chained greedy iterations (engine/worker/cuda_graphs/draft_chain.py) on CPU:
each row drafts the model's own greedy continuation, as many tokens as its count, writes KV at
those positions only, and reads NO_TOKEN after; the chain graphs' staging gives the same, and
their first iteration catching up writes the KV of the last run's last draft as well."""
from dataclasses import replace

import torch

from engine.core.batch import ScheduledSequence
from engine.core.request import SamplingParams
from engine.speculative.draft_model.chain_graphs import DraftChainGraphs, greedy_chain
from engine.worker.cuda_graphs import capture_sizes
from engine.worker.inputs import prepare_host_inputs, to_device
from engine.speculative.verify import NO_TOKEN
from eager_graphs import replay_eagerly
from spec_cases import make_llm

COUNTS = [3, 1, 0]  # drafts of rows 0, 1, 2
FIRST_TOKENS = [11, 4000, 777]


def hf_greedy(checkpoint, token: int, steps: int) -> list[int]:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    tokens = [token]
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[1:]


def rows_at_position_zero(block_size: int) -> list[ScheduledSequence]:
    """Each row its first token at position 0, in blocks of its own."""
    return [ScheduledSequence(f"r{row}", [token], 0, (2 * row, 2 * row + 1), True,
                              SamplingParams(temperature=0.0))
            for row, token in enumerate(FIRST_TOKENS)]


def check_drafts_and_kv(checkpoint, drafts: torch.Tensor, runner) -> None:
    iterations = drafts.shape[1]
    for row, count in enumerate(COUNTS):
        expected = hf_greedy(checkpoint, FIRST_TOKENS[row], count)
        assert drafts[row].tolist() == expected + [NO_TOKEN] * (iterations - count)
        for k_cache, v_cache in runner.kv_caches:
            written = k_cache[2 * row, :iterations + 1].abs().sum(dim=(1, 2)) > 0
            assert written.tolist() == [p < count for p in range(iterations + 1)]
            assert torch.equal(written, v_cache[2 * row, :iterations + 1].abs().sum((1, 2)) > 0)


def test_greedy_chain_drafts_each_rows_count_and_writes_only_their_kv(tiny_checkpoint):
    runner = make_llm(tiny_checkpoint, block_size=8).engine.runner
    rows = rows_at_position_zero(runner.block_size)
    step = to_device(prepare_host_inputs(rows, runner.block_size, runner.max_blocks_per_seq),
                     runner.device)
    with torch.inference_mode():
        drafts = greedy_chain(runner.model, runner.kv_caches, step.input_ids, step.positions,
                              step.meta, torch.tensor(COUNTS, dtype=torch.int32), 4,
                              lambda hidden: runner.model.lm_head(hidden).argmax(dim=-1))
    check_drafts_and_kv(tiny_checkpoint, drafts, runner)


def test_chain_graph_staging_gives_the_eager_chain(tiny_checkpoint, monkeypatch):
    """The graph set's iterations over its staged buffers (padded to 4 rows), replayed
    eagerly as on CPU they must be: as many as the most drafts (3 of the 4 captured)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    runner = make_llm(tiny_checkpoint, block_size=8).engine.runner
    chain = DraftChainGraphs(runner.model, runner.kv_caches, capture_sizes(4),
                             runner.max_blocks_per_seq,
                             runner.block_size, 1024, runner.device, 4)
    replay_eagerly(chain)
    with torch.inference_mode():
        drafts = chain.run(rows_at_position_zero(runner.block_size), COUNTS, [None] * 3)
    assert drafts.shape == (3, 3)
    check_drafts_and_kv(tiny_checkpoint, drafts, runner)


def test_a_catch_up_writes_the_kv_of_the_last_runs_last_draft(tiny_checkpoint, monkeypatch):
    """After a run in which row 1 drafted 3 (KV at positions 0-2), all accepted, the next run
    has row 1 at position 4 with its bonus token, catching up: its first iteration feeds the
    third draft at position 3 and the bonus at 4 in one forward. The KV at 3 and 4 and the
    draft after them are what one 5-iteration chain gives. Rows without a catch-up read the
    drafts' first entry, NO_TOKEN here (row 0 drafted none)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)
    reference = make_llm(tiny_checkpoint, block_size=8).engine.runner
    rows = rows_at_position_zero(reference.block_size)
    step = to_device(prepare_host_inputs(rows, 8, reference.max_blocks_per_seq),
                     reference.device)
    runner = make_llm(tiny_checkpoint, block_size=8).engine.runner
    chain = DraftChainGraphs(runner.model, runner.kv_caches, capture_sizes(4),
                             runner.max_blocks_per_seq, 8,
                             1024, runner.device, 3)
    replay_eagerly(chain)
    with torch.inference_mode():
        expected = greedy_chain(reference.model, reference.kv_caches, step.input_ids,
                                step.positions, step.meta,
                                torch.tensor([0, 5, 0], dtype=torch.int32), 5,
                                lambda hidden: reference.model.lm_head(hidden).argmax(dim=-1))
        assert chain.run(rows, [0, 3, 1], [None] * 3)[0, 0] == NO_TOKEN
        (k_cache, v_cache), (k_ref, v_ref) = runner.kv_caches[-1], reference.kv_caches[-1]
        assert k_cache[2, 3].abs().sum() == 0  # block 2 is row 1's: position 3 not yet
        bonus = int(expected[1, 3])
        rows[1] = replace(rows[1], token_ids=[bonus], start_position=4)
        drafts = chain.run(rows, [0, 1, 0], [None, (3, 1, 2), None])
    assert drafts[1, 0] == expected[1, 4]
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(cache[2, 3:5], ref[2, 3:5], atol=1e-5, rtol=1e-5)


def chain_start_case(rows: int = 4, iterations: int = 4, block_size: int = 4):
    """A last run of `rows` rows: row 0 accepted none of its 3 drafts, row 1 two of 4, row 2
    all 4, row 3 is padding (no drafts); each row's blocks are its own, numbered 10 r + j."""
    tables = torch.tensor([[10 * r + j for j in range(8)] for r in range(rows)],
                          dtype=torch.int32)
    inputs = dict(
        staged_positions=torch.tensor([5, 8, 3, 0]), staged_tokens=torch.tensor([50, 51, 52, 0]),
        draft_counts=torch.tensor([3, 4, 4, 0], dtype=torch.int32), block_tables=tables,
        last_drafts=torch.arange(100, 100 + rows * iterations).view(rows, iterations),
        num_accepted=torch.tensor([0, 2, 4, 0]), sampled=torch.tensor([60, 61, 62, 63]),
        block_size=block_size)
    outputs = dict(plan_positions=torch.zeros(iterations, rows, dtype=torch.int64),
                   plan_slots=torch.zeros(iterations, rows, dtype=torch.int64),
                   plan_seq_lens=torch.zeros(iterations, rows, dtype=torch.int32),
                   plan_drafted=torch.zeros(iterations, rows, dtype=torch.bool),
                   first_tokens=torch.zeros(2 * rows, dtype=torch.int64),
                   first_positions=torch.zeros(2 * rows, dtype=torch.int64),
                   first_slots=torch.zeros(2 * rows, dtype=torch.int64))
    return inputs, outputs


def test_chain_start_feeds_the_token_before_the_next_known_one():
    """A run queued ahead starts each row at the position after its last accepted draft, its
    sampled token there and before it the last accepted draft (the last run's own token if
    none), both writing KV; the plan walks on from there, as many positions as drafts."""
    from engine.speculative.draft_model.chain_start import chain_start

    inputs, out = chain_start_case()
    chain_start(**inputs, **out)
    # row 0: 5 + 0 + 1 = 6, before it the staged token 50; row 1: 8 + 3 = 11 after d2 = 105;
    # row 2: 3 + 5 = 8 after d4 = 111 (its first KV); row 3: padding at 0 and 1, no KV
    assert out["first_tokens"].tolist() == [50, 60, 105, 61, 111, 62, 0, 0]
    assert out["first_positions"].tolist() == [5, 6, 10, 11, 7, 8, 0, 1]

    def slot(row, position):  # blocks of 4 slots, row r's j-th block numbered 10 r + j
        return (10 * row + position // 4) * 4 + position % 4

    assert out["first_slots"].tolist() == [slot(0, 5), slot(0, 6), slot(1, 10), slot(1, 11),
                                           slot(2, 7), slot(2, 8), -1, -1]
    assert out["plan_positions"].t().tolist() == [[6, 7, 8, 8], [11, 12, 13, 14],
                                                  [8, 9, 10, 11], [1, 1, 1, 1]]
    assert out["plan_drafted"].t().tolist() == [[True] * 3 + [False], [True] * 4, [True] * 4,
                                                [False] * 4]
    assert out["plan_slots"][:, 0].tolist() == [slot(0, 6), slot(0, 7), slot(0, 8), -1]
    assert out["plan_slots"][:, 3].tolist() == [-1] * 4
    assert torch.equal(out["plan_seq_lens"], (out["plan_positions"] + 1).int())
