"""Whether a decode step of one or two rows runs each block in one launch (`Ops.decode_block`,
kernels/decode_layer.py) or op by op: timed at startup on this GPU for the model's block shape,
both ways in CUDA graphs, as the decode graphs would run them. No fixed rule holds: on an H100
one launch made gpt2's batch-1 steps 0.91x as long and gpt2-medium's to gpt2-xl's 1.02-1.04x
(docs/performance.md).

The timed blocks are random, as many distinct ones as the model has layers or as make their
weights 3x the GPU's L2 cache, whichever is fewer, so that neither way reads weights from
L2 that a real step would read from memory. Each sequence has CONTEXT tokens cached.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from engine.worker.attention import AttentionBackend, AttentionMetadata
from engine.worker.cuda_graphs.graph_set import capture_graph
from engine.worker.layers import Ops
from engine.worker.models.gpt2 import Block, GPT2Config
from engine.worker.quantization import quantize_block

CONTEXT = 256  # a chat turn's context; attention is a small part of a batch-1 block
ROUNDS, REPLAYS = 9, 5  # the two ways take turns ROUNDS times, REPLAYS replays each


def one_launch_rows(ops: Ops, attention: AttentionBackend, cfg: GPT2Config, max_rows: int,
                    dtype: torch.dtype, device: torch.device, quantization: str | None,
                    block_size: int) -> tuple[int, dict[int, tuple[float, float]]]:
    """The largest row count r <= max_rows such that one launch a block was faster than op
    by op at every count up to r (0: never); and the median us a block at each count timed,
    (op by op, one launch). Timing stops at the first count where one launch loses."""
    count = block_count(cfg, dtype, quantization,
                        torch.cuda.get_device_properties(device).L2_cache_size)
    blocks = random_blocks(ops, attention, cfg, dtype, device, quantization, count)

    def time_at(rows: int) -> tuple[float, float]:
        step = DecodeStep(cfg, rows, count, dtype, device, block_size)
        graphs = [capture_graph(lambda one=one: step.run(blocks, ops, one), None)[0]
                  for one in (False, True)]
        op_by_op, one_launch = _timed_alternately(graphs)
        return op_by_op / count, one_launch / count

    return rows_where_one_launch_wins(time_at, max_rows)


def rows_where_one_launch_wins(time_at: Callable[[int], tuple[float, float]], max_rows: int
                               ) -> tuple[int, dict[int, tuple[float, float]]]:
    """one_launch_rows' answer from `time_at(rows)` -> (op by op, one launch), asked at 1, 2,
    ... rows until one launch is not faster."""
    times: dict[int, tuple[float, float]] = {}
    for rows in range(1, max_rows + 1):
        times[rows] = time_at(rows)
        if times[rows][1] >= times[rows][0]:
            return rows - 1, times
    return max_rows, times


def block_count(cfg: GPT2Config, dtype: torch.dtype, quantization: str | None,
                l2_bytes: int) -> int:
    """Distinct blocks whose linear weights are 3x `l2_bytes`; at least 2, at most n_layer."""
    per_block = (4 * cfg.n_embd + 2 * cfg.n_inner) * cfg.n_embd * (
        1 if quantization else dtype.itemsize)
    return min(cfg.n_layer, max(2, -(-3 * l2_bytes // per_block)))


def random_blocks(ops: Ops, attention: AttentionBackend, cfg: GPT2Config, dtype: torch.dtype,
                  device: torch.device, quantization: str | None, count: int) -> list[Block]:
    """`count` blocks of random weights, their linears quantized as the engine's would be."""
    blocks = []
    for _ in range(count):
        with torch.device(device):
            block = Block(cfg, ops, attention).to(dtype).eval().requires_grad_(False)
        if quantization is not None:
            quantize_block(block, quantization)
        blocks.append(block)
    return blocks


class DecodeStep:
    """`rows` sequences of CONTEXT tokens, each decoding one: its inputs, metadata and the
    blocks' caches."""

    def __init__(self, cfg: GPT2Config, rows: int, layers: int, dtype: torch.dtype,
                 device: torch.device, block_size: int) -> None:
        per_seq = -(-CONTEXT // block_size)
        cache_shape = (rows * per_seq, block_size, cfg.n_head, cfg.head_dim)
        self.caches = [(torch.randn(cache_shape, dtype=dtype, device=device),
                        torch.randn(cache_shape, dtype=dtype, device=device))
                       for _ in range(layers)]
        tables = torch.arange(rows * per_seq, dtype=torch.int32, device=device)
        slots = tables.view(rows, per_seq)[:, -1].long() * block_size + (CONTEXT - 1) % block_size
        self.meta = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(rows, per_seq),
            seq_lens=torch.full((rows,), CONTEXT, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=device),
            max_query_len=1, max_seq_len=CONTEXT)
        self.hidden, self.residual = (torch.randn(rows, cfg.n_embd, dtype=dtype, device=device)
                                      for _ in range(2))

    def run(self, blocks: list[Block], ops: Ops, one_launch: bool) -> None:
        hidden, residual = self.hidden, self.residual
        for block, cache in zip(blocks, self.caches, strict=True):
            if one_launch:
                hidden, residual = ops.decode_block(block, hidden, residual, cache, self.meta)
            else:
                hidden, residual = block(hidden, residual, cache, self.meta)


def _timed_alternately(graphs: list[torch.cuda.CUDAGraph]) -> list[float]:
    """Median us a replay of each graph, the graphs taking turns."""
    times: list[list[float]] = [[] for _ in graphs]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for graph in graphs:
        graph.replay()
    for _ in range(ROUNDS):
        for graph, samples in zip(graphs, times):
            events[0].record()
            for _ in range(REPLAYS):
                graph.replay()
            events[1].record()
            events[1].synchronize()
            samples.append(events[0].elapsed_time(events[1]) * 1e3 / REPLAYS)
    return [statistics.median(samples) for samples in times]
