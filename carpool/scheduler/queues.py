"""Waiting queues: FCFS and priority. Pure Python."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator

from carpool.scheduler.request import Request


class FCFSQueue:
    """Arrival order; preempted requests go back to the front.

    ``num_prompt_tokens`` is the sum of the queued requests' prompt lengths.
    """

    def __init__(self) -> None:
        self._items: deque[Request] = deque()
        self.num_prompt_tokens = 0

    def add(self, request: Request) -> None:
        self._items.append(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def prepend(self, request: Request) -> None:
        self._items.appendleft(request)
        self.num_prompt_tokens += request.num_prompt_tokens

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        request = self._items.popleft()
        self.num_prompt_tokens -= request.num_prompt_tokens
        return request

    def remove(self, request: Request) -> None:
        self._items.remove(request)
        self.num_prompt_tokens -= request.num_prompt_tokens

    def first_eligible(self, is_eligible: Callable[[Request], bool]) -> Request | None:
        """The first request in queue order that ``is_eligible`` accepts (not
        removed); costs O(1 + number passed over)."""
        return next((r for r in self._items if is_eligible(r)), None)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival, then insertion.

    Removal is lazy: removed entries stay in the heap, marked dead, and are
    dropped when they reach the top, so ``remove`` is O(1).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        # id() of each queued request -> the sequence number of its live entry;
        # an entry whose number differs is dead (removed, maybe re-added since).
        self._live: dict[int, int] = {}
        self._counter = itertools.count()
        self.num_prompt_tokens = 0

    def add(self, request: Request) -> None:
        seq = next(self._counter)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, seq, request))
        self._live[id(request)] = seq
        self.num_prompt_tokens += request.num_prompt_tokens

    # A preempted request keeps its (priority, arrival) rank, which already
    # puts it ahead of every later arrival of its class.
    prepend = add

    def _drop_dead(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._drop_dead()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_dead()
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        self.num_prompt_tokens -= request.num_prompt_tokens
        return request

    def first_eligible(self, is_eligible: Callable[[Request], bool]) -> Request | None:
        """The first request in queue order that ``is_eligible`` accepts (not
        removed); costs O((1 + number passed over) log n)."""
        passed = []
        found = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_live(entry):
                continue  # dead entries are dropped for good
            passed.append(entry)
            if is_eligible(entry[3]):
                found = entry[3]
                break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return found

    def _is_live(self, entry: tuple[int, float, int, Request]) -> bool:
        return self._live.get(id(entry[3])) == entry[2]

    def remove(self, request: Request) -> None:
        if id(request) not in self._live:
            raise ValueError("request not queued")
        del self._live[id(request)]
        self.num_prompt_tokens -= request.num_prompt_tokens

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap) if self._is_live(entry))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
