"""The packed buffers the graphs read, as named layouts: one layout gives named views of the
stager's pinned numpy mirror and of the device tensor, so no side counts offsets by hand."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

Buffer = np.ndarray | torch.Tensor


class BufferLayout:
    """Consecutive named segments of one flat buffer, each of a shape; a segment named in
    `bits_of` holds another dtype of the same width, reinterpreted (e.g. float64 in int64)."""

    def __init__(self, bits_of: dict[str, str] | None = None,
                 **shapes: int | tuple[int, ...]):
        self.shapes = {name: (s,) if isinstance(s, int) else s for name, s in shapes.items()}
        self.bits_of = bits_of or {}
        self.offsets, offset = {}, 0
        for name, shape in self.shapes.items():
            self.offsets[name] = offset
            offset += math.prod(shape)
        self.size = offset

    def start(self, name: str) -> int:
        return self.offsets[name]

    def end(self, name: str, rows: int | None = None) -> int:
        """The end of segment `name`, or of its first `rows` rows."""
        shape = self.shapes[name]
        rows = shape[0] if rows is None else rows
        return self.offsets[name] + rows * math.prod(shape[1:])

    def views(self, buffer: Buffer) -> SimpleNamespace:
        """Each segment of `buffer` (numpy or torch, `size` elements) by name, in its shape."""
        lib = np if isinstance(buffer, np.ndarray) else torch
        views = {}
        for name, shape in self.shapes.items():
            view = buffer[self.start(name):self.end(name)].reshape(shape)
            if name in self.bits_of:
                view = view.view(getattr(lib, self.bits_of[name]))
            views[name] = view
        return SimpleNamespace(**views)


def token_layout(n: int, extra: dict[str, int | tuple[int, ...]] | None = None
                 ) -> BufferLayout:
    """The int64 buffer of a graph set with n token rows. Its first two segments are the pool
    input ids are gathered from by token source: r < n is row r of the previous step's
    samples (a placeholder's), n + r token row r's own id. `extra`: segments after the rest,
    by name and shape (a decode step's block copies and masked-draw inputs: DecodeGraphs)."""
    return BufferLayout(prev_tokens=n, token_ids=n, positions=n, slot_mapping=n,
                        token_source=n, draw_seeds=n, draw_temperature=n, **(extra or {}),
                        bits_of={"draw_temperature": "float64"})


def stage_draw_inputs(tokens: SimpleNamespace, draw_inputs: tuple[np.ndarray, np.ndarray],
                      rows: int) -> None:
    """Each sampling row's seed and temperature, then greedy padding up to `rows`."""
    temperature, seeds = draw_inputs
    samples = len(seeds)
    tokens.draw_seeds[:samples] = seeds
    tokens.draw_temperature[:samples] = temperature
    tokens.draw_seeds[samples:rows] = 0
    tokens.draw_temperature[samples:rows] = 0.0
