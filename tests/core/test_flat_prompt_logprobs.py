"""FlatPromptLogprobs: the engine's prompt logprobs kept as the chunks' columns, read as vLLM's
list of per-position maps. Against a reference that builds those maps chunk by chunk (as the
output processor did before the columns), for prompts split into random chunks, top-k 0, 1
and 3, prompt tokens inside and outside the top-k: every read (index, negative index, slice,
iteration, equality both ways) gives the reference's maps, keys in order; a chunk out of order
or overlapping is refused; the server's JSON and echoed entries read from the columns are
what they were from the maps, logprobs clamped as before."""
from __future__ import annotations

import math
import random

import msgspec
import pytest

from engine.core.batch import PromptLogprobs, TokenLogprobs
from engine.output.outputs import FlatPromptLogprobs, Logprob
from engine.output.tokenizer import Tokenizer
from server.completions import _echoed_entry
from server.protocol import PromptLogprob, finite_logprob, prompt_logprobs_json

TEXT = Tokenizer().token_string_table
VOCAB = 40  # small: the prompt token is often among the top-k


def random_chunks(rng: random.Random, prompt: list[int], k: int) -> list[PromptLogprobs]:
    """Positions 1.. of the prompt in chunks split at random points: a distinct top-k per
    position holding the prompt token about half the time (then its rank is its place)."""
    columns: tuple[list, ...] = ([], [], [], [])
    for token in prompt[1:]:
        top_ids = rng.sample([t for t in range(VOCAB) if t != token], k)
        if k and rng.random() < 0.5:
            top_ids[rng.randrange(k)] = token
        top_logprobs = sorted((rng.choice([-math.inf, -1e5, rng.uniform(-20, 0)])
                               for _ in range(k)), reverse=True)
        rank = top_ids.index(token) + 1 if token in top_ids else rng.randint(k + 1, VOCAB)
        for column, value in zip(columns, (rng.uniform(-30, 0), rank, top_ids, top_logprobs)):
            column.append(value)
    cuts = sorted(rng.sample(range(1, len(prompt) - 1), min(3, len(prompt) - 2)))
    bounds = [0, *cuts, len(prompt) - 1]
    return [PromptLogprobs(start + 1, *(column[start:end] for column in columns))
            for start, end in zip(bounds, bounds[1:])]


def reference_maps(prompt: list[int], chunks: list[PromptLogprobs]
                   ) -> list[dict[int, Logprob] | None]:
    """vLLM's list, built map by map: each token's own Logprob, then the top-k's (replacing it
    when among them: the token's key stays first)."""
    entries: list[dict[int, Logprob] | None] = [None] * len(prompt)
    for chunk in chunks:
        for i, (logprob, rank, top_ids, top_logprobs) in enumerate(zip(
                chunk.token_logprobs, chunk.ranks, chunk.top_token_ids, chunk.top_logprobs)):
            token = prompt[chunk.first_index + i]
            entry = {token: None if token in top_ids else Logprob(logprob, rank, TEXT[token])}
            for top_rank, (top, top_logprob) in enumerate(zip(top_ids, top_logprobs), 1):
                entry[top] = Logprob(top_logprob, top_rank, TEXT[top])
            entries[chunk.first_index + i] = entry
    return entries


def filled(prompt: list[int], chunks: list[PromptLogprobs]) -> FlatPromptLogprobs:
    flat = FlatPromptLogprobs(prompt, TEXT)
    for chunk in chunks:
        assert not flat.complete
        flat.add(chunk)
    assert flat.complete
    return flat


def cases() -> list[tuple[list[int], list[PromptLogprobs], list]]:
    rng = random.Random(7)
    result = []
    for k in (0, 1, 3):
        for _ in range(6):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))]
            chunks = random_chunks(rng, prompt, k)
            result.append((prompt, chunks, reference_maps(prompt, chunks)))
    return result


CASES = cases()


@pytest.mark.parametrize("prompt, chunks, expected", CASES)
def test_every_read_gives_the_reference_maps(prompt, chunks, expected):
    flat = filled(prompt, chunks)
    assert len(flat) == len(prompt) and flat[0] is None
    assert flat == expected and expected == flat and list(flat) == expected
    assert [flat[i] for i in range(-len(prompt), len(prompt))] == expected + expected
    assert [list(entry) for entry in flat[1:]] == [list(entry) for entry in expected[1:]]
    assert all(type(lp) is Logprob for entry in flat[1:] for lp in entry.values())
    rng = random.Random(len(prompt))
    for _ in range(20):
        window = slice(*(rng.choice([None, rng.randint(-50, 50)]) for _ in range(2)),
                       rng.choice([None, 1, 2, -1, -3]))
        assert flat[window] == expected[window]
    with pytest.raises(IndexError):
        flat[len(prompt)]
    with pytest.raises(IndexError):
        flat[-len(prompt) - 1]


def test_a_token_among_the_top_k_keeps_its_key_first_with_its_top_k_logprob():
    flat = FlatPromptLogprobs([5, 10, 20, 30], TEXT)
    flat.add(PromptLogprobs(1, [-1.5, -0.5], [7, 1], [[40, 41], [20, 42]],
                            [[-0.1, -0.2], [-0.5, -1.0]]))
    assert flat[3] is None and not flat.complete  # position 3 has not arrived
    flat.add(PromptLogprobs(3, [-3.1], [2], [[0, 30]], [[-0.25, -3.0]]))
    expected = [None,
                {10: Logprob(-1.5, 7, TEXT[10]), 40: Logprob(-0.1, 1, TEXT[40]),
                 41: Logprob(-0.2, 2, TEXT[41])},
                {20: Logprob(-0.5, 1, TEXT[20]), 42: Logprob(-1.0, 2, TEXT[42])},
                {30: Logprob(-3.0, 2, TEXT[30]), 0: Logprob(-0.25, 1, TEXT[0])}]
    assert flat == expected and [list(e) for e in flat[1:]] == [list(e) for e in expected[1:]]
    assert flat != expected[:3] and flat != expected[:3] + [{30: Logprob(-3.1, 2, TEXT[30])}]


def test_a_chunk_out_of_order_overlapping_or_past_the_end_is_refused():
    flat = FlatPromptLogprobs([1, 2, 3, 4, 5], TEXT)

    def chunk(first: int, count: int) -> PromptLogprobs:
        return PromptLogprobs(first, [-1.0] * count, [2] * count, [[7]] * count,
                              [[-0.5]] * count)

    for first, count in [(0, 1), (2, 1), (1, 5)]:
        with pytest.raises(IndexError, match=f"positions {first}..{first + count - 1} of a "
                                             "5-token prompt"):
            flat.add(chunk(first, count))
    flat.add(chunk(1, 2))
    for first, count in [(1, 1), (2, 2), (4, 1), (3, 3)]:  # overlapping, a gap, past the end
        with pytest.raises(IndexError):
            flat.add(chunk(first, count))
    assert not flat.complete and flat[3] is None and flat[2] is not None
    flat.add(chunk(3, 2))
    assert flat.complete and flat[-1] == {5: Logprob(-1.0, 2, TEXT[5]),
                                          7: Logprob(-0.5, 1, TEXT[7])}


def test_repr_is_short():
    flat = FlatPromptLogprobs(list(range(512)), TEXT)
    assert repr(flat) == "<FlatPromptLogprobs: positions 1..0 of a 512-token prompt>"


def reference_finite(value: float) -> float:
    """The server's clamp, as it was written."""
    return max(value, -9999.0) if math.isfinite(value) else -9999.0


def test_the_servers_clamp_of_logprobs_is_unchanged():
    values = [-1.5, 0.0, -0.0, 2.0, -9999.0, -9999.5, -1e300, -math.inf, math.inf, math.nan]
    assert msgspec.json.encode([finite_logprob(v) for v in values]) == \
        msgspec.json.encode([reference_finite(v) for v in values])


def reference_json(entries: list[dict[int, Logprob] | None]) -> bytes:
    """The server's prompt_logprobs as it built them from vLLM's maps."""
    return msgspec.json.encode([
        None if entry is None else
        {token: PromptLogprob(reference_finite(lp.logprob), lp.rank, lp.decoded_token)
         for token, lp in entry.items()} for entry in entries])


def reference_echoed_entries(prompt: list[int], entries: list[dict[int, Logprob] | None]
                             ) -> list[TokenLogprobs | None]:
    """The completions endpoint's echoed prompt entries as it built them from vLLM's maps."""
    return [None if entry is None else
            TokenLogprobs(entry[token].logprob, list(entry), [lp.logprob for lp in entry.values()])
            for token, entry in zip(prompt, entries)]


@pytest.mark.parametrize("prompt, chunks, expected", CASES)
def test_the_servers_json_and_echoed_entries_read_from_the_columns_are_unchanged(
        prompt, chunks, expected):
    flat = filled(prompt, chunks)
    assert msgspec.json.encode(prompt_logprobs_json(flat)) == reference_json(expected)
    assert [None, *(_echoed_entry(*row) for row in flat.rows())] == \
        reference_echoed_entries(prompt, expected)
