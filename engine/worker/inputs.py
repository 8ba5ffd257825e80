"""Host-side input preparation for eager steps: a step's ScheduledSequences become flat arrays
(HostInputs), then device tensors plus attention metadata (StepInputs). Steps that replay CUDA
graphs are staged by the graphs' own stagers (engine.worker.cuda_graphs).

    seqs        A: 3 new tokens at positions 5..7     B: 1 new token at position 12
    token_ids   [a5 a6 a7 b12]         positions    [5 6 7 12]
    query_start [0 3 4]                seq_lens     [8 13]
    slot        block_ids[p // block_size] * block_size + p % block_size, per token
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.attention import AttentionMetadata
from engine.core.batch import ScheduledSequence


@dataclass
class HostInputs:
    """One step's inputs as host arrays, varlen over the batch."""
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int32 [S, max_blocks_per_seq]
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]
    # int64: each sample=True sequence's last num_drafts + 1 token rows
    sample_indices: np.ndarray
    max_query_len: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num sample=True seqs] int64: each one's last token row


def is_decode_step(seqs: list[ScheduledSequence]) -> bool:
    """One new token per sequence, and every sequence samples."""
    return all(len(s.token_ids) == 1 and s.sample for s in seqs)


def prepare_host_inputs(seqs: list[ScheduledSequence], block_size: int,
                        max_blocks_per_seq: int) -> HostInputs:
    """Varlen inputs of one step, numpy over the whole batch."""
    if is_decode_step(seqs):
        return _decode_host_inputs(seqs, block_size, max_blocks_per_seq)
    new_lens = np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
    starts = np.array([s.start_position for s in seqs], dtype=np.int64)
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(new_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = np.repeat(np.arange(len(seqs)), new_lens)
    positions = starts[seq_of_token] + np.arange(num_tokens) - query_start_loc[seq_of_token]
    block_tables = _block_table_array(seqs, max_blocks_per_seq)
    block_of_token = block_tables[seq_of_token, positions // block_size].astype(np.int64)
    token_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                            dtype=np.int64, count=num_tokens)
    return HostInputs(
        token_ids=token_ids, positions=positions,
        slot_mapping=block_of_token * block_size + positions % block_size,
        block_tables=block_tables, seq_lens=(starts + new_lens).astype(np.int32),
        query_start_loc=query_start_loc.astype(np.int32),
        sample_indices=_sample_indices(seqs, query_start_loc),
        max_query_len=int(new_lens.max()))


def _sample_indices(seqs: list[ScheduledSequence], query_start_loc: np.ndarray) -> np.ndarray:
    """Token rows whose logits are sampled: each sampling sequence's last num_drafts + 1."""
    sampling = [s.sample for s in seqs]
    last = (query_start_loc[1:] - 1)[sampling]
    counts = np.array([s.num_drafts + 1 for s in seqs], dtype=np.int64)[sampling]
    if len(counts) == 0 or counts.max() == 1:
        return last
    first = np.repeat(last - counts + 1, counts)
    return first + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)


def _block_table_array(seqs: list[ScheduledSequence], width: int) -> np.ndarray:
    """Ragged block ids as a zero-padded [S, width] array."""
    table = np.zeros((len(seqs), width), dtype=np.int32)
    for row, s in enumerate(seqs):
        table[row, :len(s.block_ids)] = s.block_ids
    return table


def _decode_host_inputs(seqs: list[ScheduledSequence], block_size: int,
                        max_blocks_per_seq: int) -> HostInputs:
    """The decode step with plain lists: numpy call overheads dominate at decode sizes."""
    positions = [s.start_position for s in seqs]
    slots = [s.block_ids[p // block_size] * block_size + p % block_size
             for s, p in zip(seqs, positions)]
    rows = np.arange(len(seqs), dtype=np.int64)
    return HostInputs(
        token_ids=np.array([s.token_ids[0] for s in seqs], dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        block_tables=_block_table_array(seqs, max_blocks_per_seq),
        seq_lens=np.array(positions, dtype=np.int32) + 1,
        query_start_loc=np.arange(len(seqs) + 1, dtype=np.int32),
        sample_indices=rows, max_query_len=1)


def upload(array: np.ndarray | list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host array to device without waiting: through pinned memory on CUDA, since a copy from
    pageable memory first waits for all work queued on the device (the step in flight)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if device.type == "cuda":
        host = host.pin_memory()  # held by torch's host allocator until the copy is done
    return host.to(device, non_blocking=True)


def to_device(host: HostInputs, device: torch.device) -> StepInputs:
    def on_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return upload(array, dtype, device)

    meta = AttentionMetadata(
        slot_mapping=on_device(host.slot_mapping, torch.int64),
        block_tables=on_device(host.block_tables, torch.int32),
        seq_lens=on_device(host.seq_lens, torch.int32),
        query_start_loc=on_device(host.query_start_loc, torch.int32),
        max_query_len=host.max_query_len, max_seq_len=int(host.seq_lens.max()),
        query_start_loc_host=host.query_start_loc.tolist(), seq_lens_host=host.seq_lens.tolist())
    return StepInputs(on_device(host.token_ids, torch.int64),
                      on_device(host.positions, torch.int64), meta,
                      on_device(host.sample_indices, torch.int64))


def take_placeholders(step: StepInputs, host: HostInputs, sources: list[int],
                      prev_tokens: torch.Tensor) -> None:
    """Sequence i with sources[i] >= 0 has one new token, a placeholder: take it from row
    sources[i] of the previous step's sampled tokens (`prev_tokens`, on the device)."""
    rows = [i for i, src in enumerate(sources) if src >= 0]
    dst = upload(host.query_start_loc[rows], torch.int64, prev_tokens.device)
    src = upload([sources[i] for i in rows], torch.int64, prev_tokens.device)
    step.input_ids[dst] = prev_tokens[src]
