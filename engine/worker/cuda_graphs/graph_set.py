"""What the decode and mixed-step graph sets share: the packed device buffers with their
pinned staging mirrors, capture and replay (their sizes: plan.py)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch

from engine.worker.attention import AttentionMetadata
from engine.worker.cuda_graphs.buffers import BufferLayout, token_layout

# builds a stager from the named views of one pinned mirror: (tokens, meta) -> stager
MakeStager = Callable[[SimpleNamespace, SimpleNamespace], object]
# runs in every graph beside the model, over the same inputs: (input_ids, positions, meta)
# (a draft model writing its KV: engine/speculative/draft_model/)
Follower = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], None]


class GraphSet:
    """Graphs of one kind, one per padded size, reading two packed device buffers: `tokens`
    (int64, `token_layout`) and `meta` (int32, the subclass's layout), one byte buffer
    (`packed_buffers`), so that a step's inputs go in with one copy. Two pinned mirrors
    take turns (step N's copies may still be queued while N+1 is staged), each guarded by an
    event. A subclass defines attention_meta(size) and forward(size), what its graph records;
    the result stays in `outputs[size]` until that size's next replay. A `follower` gets its
    own graph per size over the same inputs, replayed after the model's unless told not to.
    With `step_outputs`, every size writes its logits and draws there rather than into
    buffers of its own. `extra`: segments appended to `tokens` (token_layout), copied in with
    the rest."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, sizes: list[int],
                 meta_layout: BufferLayout, device: torch.device, make_stager: MakeStager,
                 follower: Follower | None = None, step_outputs: StepOutputs | None = None,
                 extra: dict[str, int | tuple[int, ...]] | None = None):
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.follower = follower
        self.step_outputs = step_outputs
        self.token_layout = token_layout(sizes[-1], extra)
        self.meta_layout = meta_layout
        self._bytes, self._ids64, self._ids32 = packed_buffers(self.token_layout, meta_layout,
                                                               device)
        self.tokens = self.token_layout.views(self._ids64)
        self.meta = meta_layout.views(self._ids32)
        self.tokens.slot_mapping.fill_(-1)  # nothing is stored while the graphs are captured
        self._staging = [_PinnedStaging(self, make_stager, device) for _ in range(2)]
        self._steps_staged = 0
        self._token_pool = self._ids64[:self.token_layout.end("token_ids")]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.follow_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}  # what each size's forward returned

    @property
    def steps_staged(self) -> int:
        """Steps staged through the pinned mirrors (each replay stages one)."""
        return self._steps_staged

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids (gathered by token source) and positions of the first `size` rows. With
        step_outputs, a placeholder reads the previous step's draw there (Ops.gather_tokens),
        where the last graph step left it: the host copies nothing in for it."""
        source = self.tokens.token_source[:size]
        if self.step_outputs is None:
            input_ids = self._token_pool.index_select(0, source)
        else:
            input_ids = self.model.ops.gather_tokens(self.step_outputs.drawn,
                                                     self.tokens.token_ids, source,
                                                     len(self.tokens.prev_tokens))
        return input_ids, self.tokens.positions[:size]

    def _hidden(self, size: int) -> torch.Tensor:
        """The model's hidden states of the first `size` token rows."""
        return self.model(*self._inputs(size), self.kv_caches, self.attention_meta(size))

    def follow(self, size: int) -> None:
        """The follower's forward over the first `size` rows: what its graph records."""
        self.follower(*self._inputs(size), self.attention_meta(size))

    def _logits_and_draws(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draw reads the model-dtype logits (widened exactly in the kernel): no float32
        copy of every row in the graph."""
        rows, shared = hidden.shape[0], self.step_outputs
        logits = self.model.lm_head(hidden, None if shared is None else shared.logits[:rows])
        return logits, self.model.ops.sample(logits, self.tokens.draw_temperature[:rows],
                                             self.tokens.draw_seeds[:rows],
                                             out=None if shared is None else shared.drawn[:rows])

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every size, largest first, into `pool` (None: a new one). Returns the
        pool, for the next set to share."""
        for size in reversed(self.sizes):
            self.graphs[size], pool, self.outputs[size] = capture_graph(
                lambda: self.forward(size), pool)
            if self.follower is not None:
                self.follow_graphs[size], pool, _ = capture_graph(lambda: self.follow(size),
                                                                  pool)
        torch.cuda.synchronize()
        return pool

    def _replay(self, size: int, stage: Callable, prev_tokens: torch.Tensor | None,
                meta_rows: int, after_copy: Callable[[], None] | None = None,
                follow: bool = True) -> None:
        """_copy_in, `after_copy` (device writes over the copied buffers), replay, and the
        follower's graph if `follow`."""
        self._copy_in(stage, prev_tokens, meta_rows)
        if after_copy is not None:
            after_copy()
        self.graphs[size].replay()
        if follow and self.follower is not None:
            self.follow_graphs[size].replay()

    def _copy_in(self, stage: Callable, prev_tokens: torch.Tensor | None,
                 meta_rows: int) -> None:
        """stage(stager) fills the next pinned mirror; then copy it (`meta` up to its first
        `meta_rows` block-table rows) and the previous step's sampled tokens (when
        placeholders read them) in."""
        staging = self._staging[self._steps_staged % len(self._staging)]
        self._steps_staged += 1
        staging.wait_copied()
        stage(staging.stager)
        if prev_tokens is not None:
            prev = self.tokens.prev_tokens if self.step_outputs is None else self.step_outputs.drawn
            if prev_tokens.data_ptr() != prev.data_ptr():  # else a graph drew them there
                prev[:len(prev_tokens)].copy_(prev_tokens, non_blocking=True)
        # one contiguous byte range, from the token ids to the last block-table row used: a
        # strided copy from pinned memory would be staged by torch through pageable memory,
        # whose copy waits for the step still on the device
        start = 8 * self.token_layout.start("token_ids")
        end = 8 * self.token_layout.size + 4 * self.meta_layout.end("block_tables", meta_rows)
        self._bytes[start:end].copy_(staging.bytes[start:end], non_blocking=True)
        staging.mark_copied()


class StepOutputs:
    """Logits [rows + 1, padded vocab] and draws [rows + 1] that the decode and mixed-step
    graphs all write, rows 0.. of each replay: one step's outputs at a time, for its rows are
    sampled (structured outputs' late draw included) before the next step launches. The
    masked draw's graphs (masked_draw.py) read and rewrite a step's rows in place there; row
    `spare_row` is never a step's, their padding rows draw into it. One buffer instead of one
    per graph size."""

    def __init__(self, rows: int, padded_vocab: int, vocab: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.logits = torch.zeros(rows + 1, padded_vocab, dtype=dtype, device=device)
        self.drawn = torch.zeros(rows + 1, dtype=torch.int64, device=device)
        self.vocab = vocab
        self.spare_row = rows

    def holds(self, logits: torch.Tensor, drawn: torch.Tensor) -> bool:
        """Whether these are a step's rows here (what a graph set's run returned)."""
        return (logits.data_ptr() == self.logits.data_ptr()
                and drawn.data_ptr() == self.drawn.data_ptr())


def capture_graph(record: Callable, pool) -> tuple[torch.cuda.CUDAGraph, object, object]:
    """A graph of record() after one eager warm-up run (compiles kernels, settles the
    allocator), in `pool` (None: a new one); with its pool and what record() returned."""
    record()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = record()
    return graph, graph.pool(), outputs


def packed_buffers(tokens: BufferLayout, meta: BufferLayout, device: torch.device,
                   pin: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One zeroed byte buffer holding the int64 `tokens` buffer, then the int32 `meta` one
    (so a step's inputs are one contiguous copy), and those two as views of it."""
    buffer = torch.zeros(8 * tokens.size + 4 * meta.size, dtype=torch.uint8, device=device,
                         pin_memory=pin)
    return (buffer, buffer[:8 * tokens.size].view(torch.int64),
            buffer[8 * tokens.size:].view(torch.int32))


class _PinnedStaging:
    """Pinned host mirrors of a graph set's two buffers, their stager, and an event marking
    when the device has taken their last copies (a queued mirror must not be rewritten)."""

    def __init__(self, graphs: GraphSet, make_stager: MakeStager, device: torch.device):
        pin = device.type == "cuda"  # pinning needs CUDA; a draft chain stages on CPU too
        self.bytes, self.ids64, self.ids32 = packed_buffers(
            graphs.token_layout, graphs.meta_layout, torch.device("cpu"), pin)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.stager = make_stager(graphs.token_layout.views(self.ids64.numpy()),
                                  graphs.meta_layout.views(self.ids32.numpy()))

    def wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def mark_copied(self) -> None:
        """Call once this step's copies from the mirrors are queued."""
        if self._copied is not None:
            self._copied.record()
