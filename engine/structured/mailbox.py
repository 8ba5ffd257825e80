"""A grammar child's shared-memory mailbox: the core's messages to a child that is spinning
reach it without a system call on either side.

Every batch the core sends a child is numbered (1, 2, ...) and goes one of two ways: into the
mailbox, when the child is spinning and has taken the batch before; else over the socket,
numbered the same. The child runs batches in number order, reading the socket for any number
it has not seen yet, so the two ways never reorder messages. A spinning child leaves the reply
to a mask request in the mailbox too (REPLIED = the request's batch number), where the core,
which has nothing else to do then, spins for it; other replies and errors take the socket.

    core (post)                                 child (take, then spin or sleep)
    data, LEN, POST = number  (stores, in order) sees POST change, copies data, TAKEN = number
    fence; SPINNING == 0?  -> wake over socket   SPINNING = 0; fence; POST changed? -> go on;
                                                 else sleep on the socket (SLEEP_CHECK at most)

The fences (an uncontended lock: a locked instruction, a full barrier on x86) make the last
two lines a Dekker handshake: the core sees the child asleep, or the child sees the batch, so
no batch waits for a wake that never comes; SLEEP_CHECK bounds even that. The stores are plain
aligned 8-byte ones, each atomic, and x86 keeps stores in order and loads in order.
"""
from __future__ import annotations

import mmap
import pickle
import threading

import numpy as np

CAPACITY = 1 << 16  # bytes of one batch in the mailbox (a step's 16 rows: ~1 KB); larger: socket
REPLY_CAPACITY = 1 << 14  # bytes of a mask's reply (the sequences it completed); larger: socket
POST, LEN, TAKEN, SPINNING, REPLIED, REPLY_LEN = range(6)
HEADER = 8 * 8  # int64 words: the six above and two spare
SIZE = HEADER + CAPACITY + REPLY_CAPACITY  # one child's mailbox, in bytes
SPIN_SECONDS = 0.002  # a child spins this long after its last batch, then sleeps: a step apart
SLEEP_CHECK = 0.002  # a sleeping child also looks at its mailbox this often
_FENCE = threading.Lock()


def fence() -> None:
    with _FENCE:
        pass


class Mailbox:
    """One child's mailbox in `memory` (a shared mapping) at `index`."""

    def __init__(self, memory: mmap.mmap, index: int) -> None:
        self.words = np.ndarray((8,), np.int64, memory, index * SIZE)
        self.data = np.ndarray((CAPACITY,), np.uint8, memory, index * SIZE + HEADER)
        self.reply_data = np.ndarray((REPLY_CAPACITY,), np.uint8, memory,
                                     index * SIZE + HEADER + CAPACITY)

    # the core's side
    def post(self, number: int, batch: list) -> str | None:
        """Put batch `number` in the mailbox if the child spins and has taken the last one:
        None if it did not fit that way (send it over the socket); "wake" if the child went
        to sleep meanwhile (send a wake over the socket); else "posted"."""
        words = self.words
        if words[SPINNING] != 1 or words[TAKEN] != words[POST]:
            return None
        data = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        if len(data) > CAPACITY:
            return None
        self.data[:len(data)] = np.frombuffer(data, np.uint8)
        words[LEN] = len(data)
        words[POST] = number
        fence()
        return "wake" if words[SPINNING] != 1 else "posted"

    def reply_to(self, number: int):
        """The mask reply to batch `number`, if it is here (else None)."""
        if self.words[REPLIED] != number:
            return None
        return pickle.loads(self.reply_data[:int(self.words[REPLY_LEN])].tobytes())

    # the child's side
    def put_reply(self, number: int, payload) -> bool:
        """Leave the mask reply to batch `number`; False if it does not fit (use the socket)."""
        data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        if len(data) > REPLY_CAPACITY:
            return False
        self.reply_data[:len(data)] = np.frombuffer(data, np.uint8)
        self.words[REPLY_LEN] = len(data)
        self.words[REPLIED] = number
        return True

    def take(self) -> tuple[int, list] | None:
        """The batch posted since the last take, with its number, or None."""
        words = self.words
        number = int(words[POST])
        if number == words[TAKEN]:
            return None
        batch = pickle.loads(self.data[:int(words[LEN])].tobytes())
        words[TAKEN] = number
        return number, batch

    def set_spinning(self, spinning: bool) -> bool:
        """Say whether this child spins; going to sleep, whether a batch came meanwhile (then
        it stays awake)."""
        self.words[SPINNING] = int(spinning)
        if spinning:
            return False
        fence()
        if self.words[POST] != self.words[TAKEN]:
            self.words[SPINNING] = 1
            return True
        return False
