"""StructuredOutputs in child processes: a step's mask fills while the core's thread applies
the step before it, hands its outputs over and schedules the next one. xgrammar holds the
GIL while it fills, so a thread could not overlap that work; processes can, and several
split a large mask between them (each sequence's matcher lives in one child).

    core                                        children (`main`, fresh interpreters)
    submit / advance / release   ── message ─▶  the same calls on the owner's StructuredOutputs
    (a spec's first submit)      ── message ─▶  every other child compiles it too (precompile)
    request_mask(rows)           ── message ─▶  each owner fills its rows of the shared bitmask
    ... schedule the next step ...
    take_mask()                  ◀── replies ─  the sequences completed since the last one

Each child takes its requests in order (advances and releases wait for the next request, to
travel with it in one batch): through its shared-memory mailbox while it spins, else its
socket (engine/structured/mailbox.py); a spinning child's mask replies take the mailbox too,
others the socket. Children spin only where the CPUs allow (SPARE_CPUS). The bitmask lies in
an anonymous shared memory file (memfd) that every child maps, page-locked for the GPU when
`pin`. A child ends when its socket closes: when the core closes it, or when the core's
process dies.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import subprocess
import sys
import time
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import numpy as np

from engine.core.batch import GrammarMask
from engine.core.request import StructuredOutputsParams
from engine.core.cpus import usable_cpus
from engine.structured.grammar import compiler
from engine.structured.mailbox import SIZE as MAILBOX_SIZE
from engine.structured.mailbox import SLEEP_CHECK, SPIN_SECONDS, Mailbox
from engine.structured.manager import (ALL_ALLOWED, MASK_WORDS, MAX_CACHED_GRAMMARS,
                                      StructuredOutputs)

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]  # the directory holding the `engine` package
# a child fills 16 rows of a JSON schema in ~0.3 ms, well within a step's host time: fewer
# children per step mean fewer messages
SEQS_PER_CHILD = 16
CHILD_EXIT_WAIT = 10  # seconds a closing GrammarProcess waits for each child to exit
SPARE_CPUS = 4  # CPUs left besides spinning children (usable_cpus): the core, two API servers,
# one more
LIVENESS_SPINS = 4096  # the core's spins for a mask reply between looks at the child (~10 ms)


class _Child:
    """One child process, its end of their socket and the child's mailbox."""

    def __init__(self, memory_fd: int, max_rows: int, mailboxes: tuple[int, mmap.mmap],
                 index: int, spin: bool) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        mailbox_fd, mailbox_memory = mailboxes
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from engine.structured.process import main; "
             "main(sys.argv[1:])", str(theirs.fileno()), str(memory_fd), str(max_rows),
             str(mailbox_fd), str(index), str(int(spin))],
            pass_fds=(theirs.fileno(), memory_fd, mailbox_fd), env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.mailbox = Mailbox(mailbox_memory, index)
        self.spins = spin
        self._number = 0  # of the last batch sent
        self.mask_number = 0  # of the last batch asking for a mask
        self._queued: list[tuple] = []  # messages without a reply, sent with the next one
        self.num_seqs = 0  # sequences whose grammar it holds
        self._replies: dict[str, object] = {}  # replies read while waiting for another

    def queue(self, message: tuple) -> None:
        self._queued.append(message)

    def send(self, message: tuple) -> int:
        """Send the queued messages and this one, in order, as one numbered batch: into the
        mailbox where it takes it (engine/structured/mailbox.py), else over the socket; the
        batch's number."""
        batch, self._queued = [*self._queued, message], []
        self._number += 1
        posted = self.mailbox.post(self._number, batch)
        try:
            if posted is None:
                self.conn.send((self._number, batch))
            elif posted == "wake":
                self.conn.send((None, []))
        except OSError as err:
            raise RuntimeError(f"the grammar process is gone ({err})") from err
        return self._number

    def reply(self, kind: str):
        """The reply to the last `kind` request; replies to earlier requests come first."""
        while kind not in self._replies:
            self._read_reply()
        return self._replies.pop(kind)

    def mask_reply(self) -> list[str]:
        """The reply to the last mask request: a spinning child's from its mailbox (the core
        spins for it, reading the socket for an error, and looks whether the child lives every
        LIVENESS_SPINS), else from the socket."""
        if not self.spins:
            return self.reply("mask")
        spins = 0
        while (payload := self.mailbox.reply_to(self.mask_number)) is None:
            if "mask" in self._replies:
                return self._replies.pop("mask")
            if self.conn.poll(0):
                self._read_reply()
            spins += 1
            if spins % LIVENESS_SPINS == 0 and self.process.poll() is not None:
                raise RuntimeError(f"the grammar process died (exit code "
                                   f"{self.process.poll()})")
        return payload

    def _read_reply(self) -> None:
        try:
            got, payload = self.conn.recv()
        except (EOFError, OSError) as err:
            raise RuntimeError(f"the grammar process died (exit code "
                               f"{self.process.poll()})") from err
        if got == "error":
            raise RuntimeError(f"the grammar process failed: {payload}")
        self._replies[got] = payload


class GrammarProcess:
    """The Grammars protocol of engine/core/engine_core.py, served by `num_children` child
    processes."""

    def __init__(self, max_rows: int, num_children: int = 1, pin: bool = False,
                 seqs_per_child: int = SEQS_PER_CHILD, spin: bool | None = None) -> None:
        """`spin`: children spin between batches, so a batch in the mailbox needs no wake
        (None: where the CPUs allow, SPARE_CPUS besides the children)."""
        if spin is None:
            spin = usable_cpus() >= num_children + SPARE_CPUS
        size = max_rows * MASK_WORDS * 4
        memory_fd = os.memfd_create("gpt2-serve-grammar-mask")
        os.ftruncate(memory_fd, size)
        mailbox_fd = os.memfd_create("gpt2-serve-grammar-mailboxes")
        os.ftruncate(mailbox_fd, num_children * MAILBOX_SIZE)
        self._mailboxes = mmap.mmap(mailbox_fd, num_children * MAILBOX_SIZE)
        self._children = [_Child(memory_fd, max_rows, (mailbox_fd, self._mailboxes), i, spin)
                          for i in range(num_children)]
        self.pids = [child.process.pid for child in self._children]
        self._memory = mmap.mmap(memory_fd, size)
        os.close(memory_fd)
        os.close(mailbox_fd)
        self._bitmask = np.ndarray((max_rows, MASK_WORDS), np.int32, self._memory)
        pinned = pin and _pin(self._bitmask)
        # on close or collection: a registration outliving its mapping would refuse the next
        self._close = weakref.finalize(self, _stop, self._children, self._memory,
                                       self._bitmask.ctypes.data if pinned else None)
        self._seqs_per_child = seqs_per_child
        self._owner: dict[str, _Child] = {}  # seq id -> the child holding its grammar
        self._compiling: dict[str, _Child] = {}
        self._rows: list[str] = []
        self._split: _Split | None = None  # the last request's, until an owner changes
        self._asked: list[_Child] = []  # the children filling the requested mask
        self._specs_seen: OrderedDict[tuple, None] = OrderedDict()  # as the children's caches

    def submit(self, seq_id: str, spec: StructuredOutputsParams) -> None:
        """To the first child holding fewer than `seqs_per_child` sequences (else the least
        loaded): a small mask asks one child, a large one all of them. Each child caches its
        own compiles: a spec new here starts compiling in every child at once, so that the
        sequences after the first that share it find it compiled wherever they land."""
        def load(c: _Child) -> tuple[bool, int]:
            full = c.num_seqs >= self._seqs_per_child
            return full, c.num_seqs if full else 0

        child = min(self._children, key=load)
        child.num_seqs += 1
        self._owner[seq_id] = self._compiling[seq_id] = child
        self._split = None
        child.send(("submit", seq_id, spec))
        if spec.key in self._specs_seen:
            self._specs_seen.move_to_end(spec.key)
            return
        self._specs_seen[spec.key] = None
        if len(self._specs_seen) > MAX_CACHED_GRAMMARS:
            self._specs_seen.popitem(last=False)
        for other in self._children:
            if other is not child:
                other.send(("precompile", spec))

    def take_compiled(self, timeout: float = 0.0) -> list[tuple[str, str | None]]:
        """Every child with compiles under way answers; only the first waits up to
        `timeout`."""
        asked = list(dict.fromkeys(self._compiling.values()))
        for i, child in enumerate(asked):
            child.send(("take_compiled", timeout if i == 0 else 0.0))
        results = [result for child in asked for result in child.reply("take_compiled")]
        for seq_id, error in results:
            self._compiling.pop(seq_id, None)
            child = self._owner.pop(seq_id, None) if error is not None else None
            if child is not None:  # the child holds nothing of it
                child.num_seqs -= 1
                self._split = None
        return results

    def advance(self, seq_ids: list[str], tokens: list[int]) -> None:
        """StructuredOutputs.advance, one message per owner (the rows of a step's usual split
        take its shares as they are)."""
        split = self._split
        if split is not None and split.rows == seq_ids:
            shares = ((child, ids, [tokens[i] for i in at])
                      for child, (ids, at) in split.shares.items())
        else:
            by_owner: dict[_Child, tuple[list[str], list[int]]] = {}
            for seq_id, token in zip(seq_ids, tokens):
                child = self._owner.get(seq_id)
                if child is not None:
                    ids, owned = by_owner.setdefault(child, ([], []))
                    ids.append(seq_id)
                    owned.append(token)
            shares = ((child, ids, owned) for child, (ids, owned) in by_owner.items())
        for child, ids, owned in shares:
            child.queue(("advance", ids, owned))

    def request_mask(self, rows: list[str]) -> None:
        """Each owner fills its rows; a row whose sequence has no owner (released since it was
        scheduled: its token is dropped) allows every token. Rows as the last request's, with
        no owner changed since, reuse its split (a decode step's usual case)."""
        if len(rows) > len(self._bitmask):
            raise ValueError(f"{len(rows)} constrained rows; this engine masks at most "
                             f"{len(self._bitmask)} a step")
        if self._split is None or self._split.rows != rows:
            self._split = _split(rows, self._owner)
        if self._split.unowned:
            self._bitmask[self._split.unowned] = ALL_ALLOWED
        for child, (ids, at) in self._split.shares.items():
            child.mask_number = child.send(("mask", ids, at))
        self._rows, self._asked = rows, list(self._split.shares)

    def take_mask(self) -> tuple[GrammarMask, list[str]]:
        completed = sorted(c for child in self._asked for c in child.mask_reply())
        rows, self._rows, self._asked = self._rows, [], []
        return GrammarMask(rows, self._bitmask[:len(rows)]), completed

    def release(self, seq_id: str) -> None:
        self._compiling.pop(seq_id, None)
        child = self._owner.pop(seq_id, None)
        if child is not None:
            child.num_seqs -= 1
            self._split = None
            child.queue(("release", seq_id))

    def close(self) -> None:
        """Stop the children (each exits when its socket closes) and unpin the mask."""
        self._close()


class _Split(NamedTuple):
    """A mask request's rows by owner: `shares` child -> (seq ids, their bitmask rows)."""
    rows: list[str]
    shares: dict[_Child, tuple[list[str], list[int]]]
    unowned: list[int]  # rows whose sequence no child holds


def _split(rows: list[str], owner: dict[str, _Child]) -> _Split:
    shares: dict[_Child, tuple[list[str], list[int]]] = {}
    unowned = []
    for row, seq_id in enumerate(rows):
        child = owner.get(seq_id)
        if child is None:
            unowned.append(row)
            continue
        ids, at = shares.setdefault(child, ([], []))
        ids.append(seq_id)
        at.append(row)
    return _Split(list(rows), shares, unowned)


def _stop(children: list[_Child], memory: mmap.mmap, pinned_address: int | None) -> None:
    """Unpin first: a registration that outlived its mapping (a child slow to exit, say)
    would refuse the next mapping at that address, and leave CUDA's last error set for the
    next kernel launch to raise. A child that has not exited within CHILD_EXIT_WAIT is
    killed (one still importing xgrammar reads its closed socket only after)."""
    if pinned_address is not None:  # `memory` is still mapped: this call holds it
        import torch
        torch.cuda.cudart().cudaHostUnregister(pinned_address)
    for child in children:
        child.conn.close()
    for child in children:
        try:
            child.process.wait(timeout=CHILD_EXIT_WAIT)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


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


def serve(conn: Connection, bitmask: np.ndarray, mailbox: Mailbox, spin: bool) -> None:
    """A child's loop: every message in order, until the socket closes. It sets xgrammar's
    compiler up first (seconds of imports), so that its first grammar does not wait for it."""
    compiler()
    grammars = StructuredOutputs(len(bitmask), bitmask)
    for number, batch in _Inbox(conn, mailbox, spin):
        failed = []  # once a message of the batch has failed, its replies follow on the socket

        def answer(kind: str, payload, number=number, failed=failed) -> None:
            failed += [kind] if kind == "error" else []
            if failed or not (spin and kind == "mask" and mailbox.put_reply(number, payload)):
                conn.send((kind, payload))

        for message in batch:
            _handle(answer, grammars, message)


class _Inbox:
    """A child's batches in number order, from its mailbox and its socket (mailbox.py). Once
    it has run out of batches a spinning child spins SPIN_SECONDS, then sleeps on the socket."""

    def __init__(self, conn: Connection, mailbox: Mailbox, spin: bool) -> None:
        self.conn, self.mailbox, self.spin = conn, mailbox, spin
        self.ahead: dict[int, list] = {}  # batches read before their turn, by number
        mailbox.set_spinning(spin)

    def __iter__(self):
        number = 1
        while (batch := self._wait_for(number)) is not None:
            yield number, batch
            number += 1

    def _wait_for(self, number: int) -> list | None:
        """Batch `number` (None once the socket has closed)."""
        awake_until = time.monotonic() + SPIN_SECONDS if self.spin else 0.0
        while number not in self.ahead:
            taken = self.mailbox.take()
            if taken is not None:
                self.ahead[taken[0]] = taken[1]
                continue
            ready = self.conn.poll(0)
            if not ready and time.monotonic() >= awake_until:  # asleep until the socket speaks
                if self.mailbox.set_spinning(False):  # a batch came while it was deciding
                    continue
                ready = self.conn.poll(SLEEP_CHECK if self.spin else None)
                if ready and self.spin:
                    self.mailbox.set_spinning(True)
                    awake_until = time.monotonic() + SPIN_SECONDS
            if ready:
                try:
                    got, batch = self.conn.recv()
                except (EOFError, OSError):
                    return None
                if got is not None:  # else a wake
                    self.ahead[got] = batch
        return self.ahead.pop(number)


def _handle(answer, grammars: StructuredOutputs, message: tuple) -> None:
    """One message; `answer(kind, payload)` replies. An exception is the reply to the next
    request, over the socket (the core fails on it)."""
    kind, *args = message
    try:
        if kind == "submit":
            grammars.submit(*args)
        elif kind == "precompile":
            grammars.precompile(*args)
        elif kind == "advance":
            grammars.advance(*args)
        elif kind == "release":
            grammars.release(*args)
        elif kind == "take_compiled":
            answer(kind, grammars.take_compiled(*args))
        elif kind == "mask":
            grammars.request_mask(*args)
            answer(kind, grammars.take_mask()[1])
        else:
            raise ValueError(f"unknown message {kind!r}")
    except Exception as exc:
        log.exception("grammar process: %s failed", kind)
        answer("error", f"{kind}: {type(exc).__name__}: {exc}")


def main(argv: list[str]) -> None:
    conn_fd, memory_fd, max_rows, mailbox_fd, index, spin = (int(a) for a in argv)
    memory = mmap.mmap(memory_fd, max_rows * MASK_WORDS * 4)
    os.close(memory_fd)
    mailboxes = mmap.mmap(mailbox_fd, (index + 1) * MAILBOX_SIZE)
    os.close(mailbox_fd)
    serve(Connection(conn_fd), np.ndarray((max_rows, MASK_WORDS), np.int32, memory),
          Mailbox(mailboxes, index), bool(spin))
