"""Test doubles shared by the test modules: a torch-free runner whose fake KV cache is
prefix-dependent (FakeRunner, PipelinedFakeRunner) and scripted proposers.

Like real K/V, the fake cache entry of position p depends on the whole prefix up to p: it is
a rolling hash, computed from the entry of p-1 read back through the block table. So a wrong
block table, a block shared between different prefixes, a shared block overwritten, or a token
lost or repeated across preemption changes the output and differs from `reference_output`."""
from __future__ import annotations

import pickle
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.core.batch import PLACEHOLDER_TOKEN, RunnerOutput, SchedulerOutput, StepRows
from engine.core.messages import AddSequences
from engine.speculative.proposer import DraftContext

VOCAB = 97


def kv_entry(previous: int, token: int) -> int:
    return (previous * 1_000_003 + token + 1) % (1 << 61)


def next_token(last_entry: int) -> int:
    return last_entry % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    entry, out = 0, []
    for token in prompt:
        entry = kv_entry(entry, token)
    for _ in range(max_tokens):
        out.append(next_token(entry))
        entry = kv_entry(entry, out[-1])
    return out


class FakeRunner:
    """Writes token ids into slots (as K/V would be written), then reads each sequence's
    context back through its block table."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots = [None] * (num_blocks * block_size)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        ids, tokens = [], []
        for seq in out.sequences:
            entry = self._read(seq.block_ids, seq.start_position - 1)
            for offset, token in enumerate(seq.token_ids):
                entry = kv_entry(entry, token)
                self.slots[self._slot(seq.block_ids, seq.start_position + offset)] = entry
            if seq.sample:
                ids.append(seq.request_id)
                tokens.append(next_token(self._read(seq.block_ids, seq.seq_len - 1)))
        return RunnerOutput(ids, tokens, [None] * len(ids))

    def _read(self, block_ids: list[int], position: int) -> int:
        if position < 0:
            return 0
        entry = self.slots[self._slot(block_ids, position)]
        assert entry is not None, "read a slot nothing wrote"
        return entry

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size


@dataclass(frozen=True)
class CompletedStep:
    """What a fake runner that runs each step at launch returns from launch(): a pending
    step whose wait() has nothing to wait for."""
    result: RunnerOutput

    def wait(self) -> RunnerOutput:
        return self.result


class PipelinedFakeRunner(FakeRunner):
    """Runs each step at launch; a placeholder token becomes the token in row
    prev_sample_row of what the previous launch (step step_id - 1) sampled, as the real runner
    reads it from the device. A wrong row gives a wrong token, so outputs differ from the
    reference. A continued step (SchedulerOutput.continued) runs as its expanded rows."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.num_kv_blocks = num_blocks
        self.last: tuple[int, list[int]] | None = None  # (step id, sampled tokens)
        self.placeholders_filled = 0
        self.step_rows = StepRows()

    def launch(self, out: SchedulerOutput) -> CompletedStep:
        out = self.step_rows.full(out)
        resolved = []
        for seq in out.sequences:
            assert (seq.prev_sample_row >= 0) == (seq.token_ids == [PLACEHOLDER_TOKEN])
            if seq.prev_sample_row >= 0:
                step_id, sampled = self.last
                assert step_id == out.step_id - 1
                seq = replace(seq, token_ids=[sampled[seq.prev_sample_row]])
                self.placeholders_filled += 1
            assert PLACEHOLDER_TOKEN not in seq.token_ids
            resolved.append(seq)
        result = self.execute(replace(out, sequences=resolved))
        self.last = (out.step_id, result.sampled_token_ids)
        return CompletedStep(result)



class ScriptedProposer:
    """A proposer that drafts what the test scripted for each request: the scripted tokens at
    the output positions after those already generated, up to k. A request with no script
    gets no drafts."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[int]] = {}

    def add(self, request_id: str, tokens: Sequence[int]) -> None:
        self.scripts[request_id] = list(tokens)

    def propose(self, context: DraftContext) -> list[int]:
        start = len(context.output_token_ids)
        return self.scripts.get(context.request_id, [])[start:start + context.max_drafts]

    def release(self, request_id: str) -> None:
        self.scripts.pop(request_id, None)


def drafts_at_rate(reference: Sequence[int], rate: float, seed: int,
                   vocab_size: int) -> list[int]:
    """reference with each token kept with probability `rate` and otherwise replaced by the
    next id: scripted drafts that a target whose output is `reference` accepts at that rate
    (all of them at 1, none at 0)."""
    rng = random.Random(seed)
    return [t if rng.random() < rate else (t + 1) % vocab_size for t in reference]


class RecordingRunner:
    """Passes each step to a real runner and keeps the step (pickled, as a replay reads it)
    and its output."""

    def __init__(self, runner):
        self.runner, self.num_kv_blocks = runner, runner.num_kv_blocks
        self.steps: list[bytes] = []
        self.outputs: list[RunnerOutput] = []

    def launch(self, out: SchedulerOutput):
        self.steps.append(pickle.dumps(out))
        pending = self.runner.launch(out)
        self.outputs.append(pending.wait())
        return pending


class ScriptedCore:
    """A CoreConnection whose core is the test: it keeps what the engine sends (`sent`, and
    `seq_ids` of the sequences added), and the test delivers messages itself, synchronously,
    as CoreClient's reader does with all that arrived."""
    max_model_len, pool_tokens, client_index = 1024, 1 << 20, 0
    block_size, max_num_seqs = 16, 256

    def __init__(self) -> None:
        self.sent: list = []
        self.seq_ids: list[str] = []

    def start(self, deliver) -> None:
        self.deliver = deliver

    def send(self, message) -> None:
        self.sent.append(message)
        if isinstance(message, AddSequences):
            self.seq_ids += [sequence.seq_id for sequence in message.sequences]

    def is_alive(self) -> bool:
        return True

    async def stop(self, timeout: float) -> None:
        pass
