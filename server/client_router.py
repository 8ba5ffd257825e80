"""The engine core's side of several API servers (`--api-server-count N`): which server each
sequence came from, so that each gets only its own sequences' outputs.

    API server 0 ─AddSequences(client=0)─┐                ┌─StepOutput(its outputs, stats)─▶ 0
    API server 1 ─AddSequences(client=1)─┴─▶ engine core ─┴─StepOutput(its outputs, stats)─▶ 1

Every server gets every step's StepOutput, its own outputs in it (maybe none) and the engine's
stats: a steady stream of them is each server's sign of life (its watchdog) and keeps its
gauges current. Pure Python: no sockets here.
"""
from __future__ import annotations

from engine.core.messages import (AbortSequences, AddSequences, CoreFailed, CoreRequest,
                                  FromCore, NewTokens, SequenceFailed, SequenceOutput, StepOutput,
                                  ToCore)


def _reported_ids(sequence: CoreRequest) -> list[str]:
    """The sequence ids the core reports a CoreRequest's outputs under: its own, or for a
    beam search ('<id>#0') its results '<id>#<rank>', one per beam (engine/core/beam.py)."""
    if sequence.beam is None:
        return [sequence.seq_id]
    return [f"{sequence.seq_id[:-1]}{rank}" for rank in range(sequence.beam.beam_width)]


class ClientRouter:
    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self._client_of: dict[str, int] = {}  # live sequence -> its API server

    def note(self, message: ToCore) -> None:
        """Record (or forget) the senders of a message the core received."""
        if self.num_clients == 1:
            return
        if isinstance(message, AddSequences):
            if not 0 <= message.client < self.num_clients:
                raise ValueError(f"AddSequences from client {message.client}; the core "
                                 f"serves {self.num_clients}")
            for sequence in message.sequences:
                for seq_id in _reported_ids(sequence):
                    self._client_of[seq_id] = message.client
        elif isinstance(message, AbortSequences):
            for seq_id in message.seq_ids:
                self._client_of.pop(seq_id, None)

    def route(self, message: FromCore) -> list[tuple[int, FromCore]]:
        """(client, message) pairs: what each API server is sent for one message of the core."""
        if self.num_clients == 1:
            return [(0, message)]
        if isinstance(message, CoreFailed):
            return [(client, message) for client in range(self.num_clients)]
        if isinstance(message, SequenceFailed):
            return [(self._client_of.pop(message.seq_id, 0), message)]
        outputs: list[list[SequenceOutput]] = [[] for _ in range(self.num_clients)]
        for output in message.outputs:
            client = (self._client_of.pop(output.seq_id, 0) if output.finish_reason is not None
                      else self._client_of.get(output.seq_id, 0))
            outputs[client].append(output)
        new_tokens = [NewTokens([], [], []) for _ in range(self.num_clients)]
        if message.new_tokens is not None:  # never a sequence's last output
            new = message.new_tokens
            for row in zip(new.seq_ids, new.token_ids, new.token_times):
                own = new_tokens[self._client_of.get(row[0], 0)]
                own.seq_ids.append(row[0])
                own.token_ids.append(row[1])
                own.token_times.append(row[2])
        return [(client, StepOutput(own, message.stats, new if new.seq_ids else None))
                for client, (own, new) in enumerate(zip(outputs, new_tokens))]
