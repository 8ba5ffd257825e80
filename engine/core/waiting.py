"""The scheduler's waiting queues, one per policy, with one interface: append, appendleft (a
preempted request goes back to the front, where the policy has one), first, popleft, and
removal by id (an abort must not scan a long queue)."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from engine.core.request import Request


class WaitingQueue:
    """FCFS queue with O(1) append, push to the front, pop, and removal by id (an abort must
    not scan a long queue)."""

    def __init__(self) -> None:
        self._requests: OrderedDict[str, Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests.values())

    def append(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def appendleft(self, request: Request) -> None:
        self.append(request)
        self._requests.move_to_end(request.request_id, last=False)

    def first(self) -> Request:
        return next(iter(self._requests.values()))

    def popleft(self) -> Request:
        return self._requests.popitem(last=False)[1]

    def remove(self, request_id: str) -> None:
        del self._requests[request_id]


def priority_key(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then arrival_time."""
    return request.priority, request.arrival_time


class PriorityWaitingQueue:
    """The priority policy's waiting queue: a heap on (priority, arrival_time) with
    WaitingQueue's interface. Removal by id is O(1) and leaves a stale entry that pops skip
    (matched by serial, so a reused id never revives one); the heap is rebuilt once stale
    entries outnumber live ones."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._serial_of: dict[str, int] = {}  # request id -> serial of its live heap entry
        self._heap: list[tuple[int, float, int, Request]] = []
        self._serials = itertools.count()

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        """In the order popleft would take them (O(n log n): for tests and checks)."""
        return (entry[3] for entry in sorted(self._live()))

    def append(self, request: Request) -> None:
        serial = next(self._serials)
        self._requests[request.request_id] = request
        self._serial_of[request.request_id] = serial
        heapq.heappush(self._heap, (*priority_key(request), serial, request))

    appendleft = append  # the key, not the end it joins, places a request

    def first(self) -> Request:
        while self._serial_of.get(self._heap[0][3].request_id) != self._heap[0][2]:
            heapq.heappop(self._heap)  # removed since it was pushed
        return self._heap[0][3]

    def popleft(self) -> Request:
        request = self.first()
        heapq.heappop(self._heap)
        self.remove(request.request_id)
        return request

    def remove(self, request_id: str) -> None:
        del self._requests[request_id]
        del self._serial_of[request_id]
        if len(self._heap) > 2 * len(self._requests) + 64:  # mostly stale: rebuild
            self._heap = self._live()
            heapq.heapify(self._heap)

    def _live(self) -> list[tuple[int, float, int, Request]]:
        return [e for e in self._heap if self._serial_of.get(e[3].request_id) == e[2]]
