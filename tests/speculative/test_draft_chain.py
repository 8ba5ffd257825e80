"""The draft's chained greedy iterations (engine/speculative/draft_model/chain_graphs.py) on
CPU, where the chain runs uncaptured, the very calls its CUDA graphs record: a run drafts each
row's own greedy continuation, as many tokens as its count, writes KV at those positions only
and reads NO_TOKEN after; a run queued ahead behind a verification drafts what a run from the
verified tokens drafts, and writes the KV that run has; and the start op that plans both."""
import torch

from engine.core.batch import ScheduledSequence
from engine.core.request import SamplingParams
from engine.speculative.draft_model.chain_graphs import DraftChain
from engine.speculative.draft_model.chain_start import chain_start
from engine.speculative.verify import NO_TOKEN
from engine.worker.cuda_graphs import capture_sizes
from spec_cases import make_llm

COUNTS = [3, 1, 0]  # drafts of rows 0, 1, 2
FIRST_TOKENS = [11, 4000, 777]
BLOCK_SIZE = 4  # a row's 8 positions span its two blocks


def hf_greedy(checkpoint, token: int, steps: int) -> list[int]:
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    tokens = [token]
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[1:]


def rows_at(tokens: list[int], positions: list[int]) -> list[ScheduledSequence]:
    """Row r: tokens[r] at positions[r], in blocks 2r and 2r + 1."""
    return [ScheduledSequence(f"r{row}", [token], position, (2 * row, 2 * row + 1), True,
                              SamplingParams(temperature=0.0))
            for row, (token, position) in enumerate(zip(tokens, positions))]


def chain_on(checkpoint, iterations: int):
    """A fresh runner's KV pool and an uncaptured chain of up to `iterations` over it, padded
    to sizes 1, 2, 4."""
    runner = make_llm(checkpoint, block_size=BLOCK_SIZE).engine.runner
    return runner, DraftChain(runner.model, runner.kv_caches, capture_sizes(4),
                                    runner.max_blocks_per_seq, BLOCK_SIZE, runner.device,
                                    iterations)


def kv_of_row(runner, row: int) -> list[torch.Tensor]:
    """Each layer's K and V at row `row`'s 8 positions (its two blocks)."""
    return [cache[2 * row:2 * row + 2].flatten(0, 1) for layer in runner.kv_caches
            for cache in layer]


def written(runner, row: int) -> list[bool]:
    """Which of row `row`'s 8 positions hold KV (the pool starts zeroed)."""
    return (kv_of_row(runner, row)[0].abs().sum(dim=(1, 2)) > 0).tolist()


def test_a_run_drafts_each_rows_greedy_continuation_and_writes_only_its_kv(tiny_checkpoint):
    """Three rows (padded to 4) drafting 3, 1 and 0 tokens: as many iterations as the most
    drafts, each row's drafts the model's greedy continuation, then NO_TOKEN."""
    runner, chain = chain_on(tiny_checkpoint, 4)
    with torch.inference_mode():
        drafts = chain.run(rows_at(FIRST_TOKENS, [0, 0, 0]), COUNTS)
    assert drafts.shape == (3, 3)
    for row, count in enumerate(COUNTS):
        expected = hf_greedy(tiny_checkpoint, FIRST_TOKENS[row], count)
        assert drafts[row].tolist() == expected + [NO_TOKEN] * (3 - count)
        assert written(runner, row) == [p < count for p in range(8)]
    assert chain.steps_staged == 1


def test_a_run_queued_ahead_drafts_what_a_run_from_the_verified_tokens_drafts(
        tiny_checkpoint):
    """Rows fed at 0 drew 3 drafts each; their verification accepted A = 0, 2 and all 3,
    then sampled s. The run queued ahead reads A and s on the device: each row starts at
    A + 1 with s, and row 2, which accepted all, first feeds its third draft at 3, whose KV
    no run had written. Its drafts and the draft's KV equal those of a pool that was fed the
    verified tokens (t and the accepted drafts, by a run of A + 1) and then drafted from s.
    Row 3, padding, writes nothing."""
    accepted, sampled, counts = [0, 2, 3, 0], [901, 902, 903, 0], [3, 3, 3, 0]
    rows = rows_at(FIRST_TOKENS + [5], [0] * 4)
    runner, chain = chain_on(tiny_checkpoint, 3)
    reference, fresh = chain_on(tiny_checkpoint, 4)
    with torch.inference_mode():
        last = chain.run(rows, counts).clone()
        chain.run_ahead(rows, counts, torch.tensor(accepted), torch.tensor(sampled))
        ahead = chain.drafts[:4, :3]
        verified = fresh.run(rows, [a + 1 for a in accepted[:3]] + [0])
        for row, a in enumerate(accepted):  # it fed the same accepted drafts
            assert torch.equal(verified[row, :a], last[row, :a])
        expected = fresh.run(rows_at(sampled, [a + 1 for a in accepted]), counts)
    assert torch.equal(ahead, expected)
    assert ahead[3].tolist() == [NO_TOKEN] * 3
    for row, a in enumerate(accepted[:3]):
        assert written(runner, row) == [p < a + 4 for p in range(8)]
        for got, want in zip(kv_of_row(runner, row), kv_of_row(reference, row)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert written(runner, 3) == [False] * 8


def chain_start_case(rows: int = 4, iterations: int = 4, block_size: int = 4):
    """Four rows: row 0 staged by the host (nothing accepted), row 1 accepted two of its 4
    drafts, row 2 all 4, row 3 is padding (no drafts); each row's blocks are its own,
    numbered 10 r + j."""
    tables = torch.tensor([[10 * r + j for j in range(8)] for r in range(rows)],
                          dtype=torch.int32)
    inputs = dict(
        positions=torch.tensor([6, 9, 4, 0]), next_tokens=torch.tensor([60, 61, 62, 63]),
        draft_counts=torch.tensor([3, 4, 4, 0], dtype=torch.int32), block_tables=tables,
        last_drafts=torch.arange(100, 100 + rows * iterations).view(rows, iterations),
        num_accepted=torch.tensor([0, 2, 4, 0], dtype=torch.int32), block_size=block_size)
    outputs = dict(plan_positions=torch.zeros(iterations, rows, dtype=torch.int64),
                   plan_slots=torch.zeros(iterations, rows, dtype=torch.int64),
                   plan_seq_lens=torch.zeros(iterations, rows, dtype=torch.int32),
                   plan_drafted=torch.zeros(iterations, rows, dtype=torch.bool),
                   first_tokens=torch.zeros(2 * rows, dtype=torch.int64),
                   first_positions=torch.zeros(2 * rows, dtype=torch.int64),
                   first_slots=torch.zeros(2 * rows, dtype=torch.int64),
                   first_query_starts=torch.zeros(rows + 1, dtype=torch.int32),
                   first_rows=torch.zeros(rows, dtype=torch.int64))
    return inputs, outputs


def test_chain_start_moves_rows_on_by_their_accepted_drafts():
    """Each row starts at its staged position + its accepted drafts with its next token; a
    row that accepted all its drafts feeds the last one before it (two token rows, packed);
    the plan walks on from there, as many positions as drafts."""
    inputs, out = chain_start_case()
    chain_start(**inputs, **out)
    # row 0 at 6; row 1 at 9 + 2 = 11; row 2 at 4 + 4 = 8 after d4 = 111 at 7 (its first
    # KV); row 3 padding: token 0 at 0, no KV; then padding token rows up to 8
    assert out["first_tokens"].tolist() == [60, 61, 111, 62, 0, 0, 0, 0]
    assert out["first_positions"].tolist() == [6, 11, 7, 8, 0, 0, 0, 0]
    assert out["first_query_starts"].tolist() == [0, 1, 2, 4, 5]
    assert out["first_rows"].tolist() == [0, 1, 3, 4]

    def slot(row, position):  # blocks of 4 slots, row r's j-th block numbered 10 r + j
        return (10 * row + position // 4) * 4 + position % 4

    assert out["first_slots"].tolist() == [slot(0, 6), slot(1, 11), slot(2, 7), slot(2, 8),
                                           -1, -1, -1, -1]
    assert out["plan_positions"].t().tolist() == [[6, 7, 8, 8], [11, 12, 13, 14],
                                                  [8, 9, 10, 11], [0, 0, 0, 0]]
    assert out["plan_drafted"].t().tolist() == [[True] * 3 + [False], [True] * 4, [True] * 4,
                                                [False] * 4]
    assert out["plan_slots"][:, 0].tolist() == [slot(0, 6), slot(0, 7), slot(0, 8), -1]
    assert out["plan_slots"][:, 3].tolist() == [-1] * 4
    assert torch.equal(out["plan_seq_lens"], (out["plan_positions"] + 1).int())
