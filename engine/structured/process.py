"""StructuredOutputs in a child process: a step's mask fills while the core's thread applies
the step before it, hands its outputs over and schedules the next one. xgrammar holds the
GIL while it fills, so a thread could not overlap that work; a process can.

    core                                        child (`main`, in a fresh interpreter)
    submit / advance / release   ── message ─▶  the same calls on its StructuredOutputs
    request_mask(rows)           ── message ─▶  take_mask() fills the shared bitmask rows
    ... schedule the next step ...
    take_mask()                  ◀── reply ───  the sequences completed since the last one

Requests and replies go through one socket in order (advances and releases wait for the next
request, to travel with it in one message); the bitmask through an anonymous shared memory
file (memfd), page-locked for the GPU when `pin`. The child ends when its socket
closes: when the core closes it, or when the core's process dies.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from engine.core.batch import GrammarMask
from engine.core.request import StructuredOutputsParams
from engine.structured.manager import MASK_WORDS, StructuredOutputs

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]  # the directory holding the `engine` package


class GrammarProcess:
    """The Grammars protocol of engine/core/engine_core.py, served by a child process."""

    def __init__(self, max_rows: int, fill_threads: int = 1, pin: bool = False) -> None:
        size = max_rows * MASK_WORDS * 4
        memory_fd = os.memfd_create("gpt2-serve-grammar-mask")
        os.ftruncate(memory_fd, size)
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        self._child = subprocess.Popen(
            [sys.executable, "-c", "import sys; from engine.structured.process import main; "
             "main(sys.argv[1:])", str(theirs.fileno()), str(memory_fd), str(max_rows),
             str(fill_threads)],
            pass_fds=(theirs.fileno(), memory_fd), env=env)
        theirs.close()
        self.pid = self._child.pid
        self._memory = mmap.mmap(memory_fd, size)
        os.close(memory_fd)
        self._bitmask = np.ndarray((max_rows, MASK_WORDS), np.int32, self._memory)
        self._conn = Connection(ours.detach())
        pinned = pin and _pin(self._bitmask)
        # on close or collection: a registration outliving its mapping would refuse the next
        self._close = weakref.finalize(self, _stop, self._conn, self._child, self._memory,
                                       self._bitmask.ctypes.data if pinned else None)
        self._replies: dict[str, object] = {}  # replies read while waiting for another
        self._queued: list[tuple] = []  # messages without a reply, sent with the next one
        self._rows: list[str] | None = None

    def submit(self, seq_id: str, spec: StructuredOutputsParams) -> None:
        self._send(("submit", seq_id, spec))

    def take_compiled(self, timeout: float = 0.0) -> list[tuple[str, str | None]]:
        self._send(("take_compiled", timeout))
        return self._reply("take_compiled")

    def advance(self, seq_id: str, tokens: list[int]) -> None:
        self._queued.append(("advance", seq_id, tokens))

    def request_mask(self, rows: list[str]) -> None:
        if len(rows) > len(self._bitmask):
            raise ValueError(f"{len(rows)} constrained rows; this engine masks at most "
                             f"{len(self._bitmask)} a step")
        self._send(("mask", rows))
        self._rows = rows

    def take_mask(self) -> tuple[GrammarMask, list[str]]:
        rows, self._rows = self._rows or [], None
        completed = self._reply("mask")
        return GrammarMask(rows, self._bitmask[:len(rows)]), completed

    def release(self, seq_id: str) -> None:
        self._queued.append(("release", seq_id))

    def close(self) -> None:
        """Stop the child (it exits when its socket closes) and unpin the mask's memory."""
        self._close()

    def _send(self, message: tuple) -> None:
        """Send the queued messages and this one, in order, as one."""
        batch, self._queued = [*self._queued, message], []
        try:
            self._conn.send(batch)
        except OSError as err:
            raise RuntimeError(f"the grammar process is gone ({err})") from err

    def _reply(self, kind: str):
        """The reply to the last `kind` request; replies to earlier requests come first."""
        while kind not in self._replies:
            try:
                got, payload = self._conn.recv()
            except (EOFError, OSError) as err:
                raise RuntimeError(f"the grammar process died (exit code "
                                   f"{self._child.poll()})") from err
            if got == "error":
                raise RuntimeError(f"the grammar process failed: {payload}")
            self._replies[got] = payload
        return self._replies.pop(kind)


def _stop(conn: Connection, child: subprocess.Popen, memory: mmap.mmap,
          pinned_address: int | None) -> None:
    conn.close()
    child.wait(timeout=10)
    if pinned_address is not None:  # `memory` is still mapped: this call holds it
        import torch
        torch.cuda.cudart().cudaHostUnregister(pinned_address)


def _pin(array: np.ndarray) -> bool:
    """Page-lock the array's memory for CUDA copies; False (copies then stage) if refused."""
    import torch

    try:
        code = int(torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0))
    except Exception as err:  # no CUDA, or a torch without the call: the copies stage
        code = err
    if code != 0:
        log.warning("could not page-lock the grammar mask (%s); its copies will stage", code)
    return code == 0


def serve(conn: Connection, bitmask: np.ndarray, fill_threads: int) -> None:
    """The child's loop: every message in order, until the socket closes."""
    grammars = StructuredOutputs(len(bitmask), bitmask, fill_threads)
    while True:
        try:
            batch = conn.recv()
        except (EOFError, OSError):
            return
        for message in batch:
            _handle(conn, grammars, message)


def _handle(conn: Connection, grammars: StructuredOutputs, message: tuple) -> None:
    """One message; an exception is the reply to the next request (the core fails on it)."""
    kind, *args = message
    try:
        if kind == "submit":
            grammars.submit(*args)
        elif kind == "advance":
            grammars.advance(*args)
        elif kind == "release":
            grammars.release(*args)
        elif kind == "take_compiled":
            conn.send((kind, grammars.take_compiled(*args)))
        elif kind == "mask":
            grammars.request_mask(*args)
            conn.send((kind, grammars.take_mask()[1]))
        else:
            raise ValueError(f"unknown message {kind!r}")
    except Exception as exc:
        log.exception("grammar process: %s failed", kind)
        conn.send(("error", f"{kind}: {type(exc).__name__}: {exc}"))


def main(argv: list[str]) -> None:
    conn_fd, memory_fd, max_rows, fill_threads = (int(a) for a in argv)
    memory = mmap.mmap(memory_fd, max_rows * MASK_WORDS * 4)
    os.close(memory_fd)
    serve(Connection(conn_fd), np.ndarray((max_rows, MASK_WORDS), np.int32, memory),
          fill_threads)

