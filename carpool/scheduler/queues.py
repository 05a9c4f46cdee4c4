"""Waiting queues: FIFO lanes merged by arrival or by aged priority, and the
expiry heap of deadlines and queue timeouts. Pure Python."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator

from carpool.scheduler.request import Request

# (base priority, or 0 under FCFS; whether the prompt is long; a P/D handoff)
LaneKey = tuple[int, bool, bool]
# An expiry heap compacts once it holds at least this many entries.
_MIN_COMPACT = 64


def is_long_prompt(request: Request, threshold: int | None) -> bool:
    """Whether ``request`` belongs to the long class of the dual queue."""
    return threshold is not None and request.num_prompt_tokens > threshold


class LaneQueue:
    """Waiting requests in FIFO lanes, one per (priority class, length class,
    handoff).

    A request's lane is its base ``priority`` (all requests share class 0
    when ``by_priority`` is false), whether its prompt is long (more than
    ``long_threshold`` tokens; a handoff's never is: its prompt is loaded,
    not prefilled here) and whether it is a P/D handoff (``kv_handoff``).
    ``add`` appends to the lane, ``prepend`` (for preempted requests) puts
    the request at the lane's front.

    Queue order repeatedly takes the best lane head:

    - FCFS (``by_priority`` false): handoffs first, then lowest insertion
      sequence. Without handoffs ``prepend`` takes a sequence below every
      other, so the order is exactly that of a single deque with
      ``appendleft``; the length split only lets callers pass over the
      long lanes.
    - priority: lowest (effective priority, not a handoff, arrival_time,
      sequence), where
      effective = priority - floor(waited / aging_interval) and waited =
      clock() - arrival_time (at least 0); with ``aging_interval`` None the
      effective priority is the base priority.

    Aging bound: let r (base priority p) arrive at t0, let p_top be the best
    base priority among later arrivals, k = max(0, p - p_top) and I the
    aging interval. A request q (base p_q >= p_top) arriving at
    t_q >= t0 + k*I waited at least k*I less than r at every instant, so
    floor(waited_r / I) >= floor(waited_q / I) + k and
    eff(r) <= p_top - floor(waited_q / I) <= eff(q); r wins the tie by its
    earlier arrival. So r ranks ahead of every request arriving at or after
    t0 + k*I, forever: only earlier arrivals can be served before it, and
    r is first scheduled by t0 + k*I plus the time the server needs to
    start those of them still waiting at t0 + k*I (and to free a slot and
    blocks for r). The scheduler keeps queue order except for requests
    passed over (session-blocked, or long once the long share is spent),
    and only the first eligible request may preempt.

    Costs: ``add``, ``prepend``, ``remove`` O(1); ``peek``, ``pop``
    O(lanes); ``first_eligible`` O(lanes + passed over * log lanes).
    """

    def __init__(self, clock: Callable[[], float], by_priority: bool = False,
                 aging_interval: float | None = None, long_threshold: int | None = None) -> None:
        self._clock = clock
        self._by_priority = by_priority
        self._aging = aging_interval if by_priority else None
        self._long_threshold = long_threshold
        # Each lane maps request -> sequence number, front first; never empty.
        self._lanes: dict[LaneKey, OrderedDict[Request, int]] = {}
        self._lane_of: dict[Request, LaneKey] = {}
        self._next_seq = 0
        self._front_seq = -1
        self.num_prompt_tokens = 0  # sum of the queued requests' prompt lengths
        self.num_long = 0  # queued requests with a long prompt

    @property
    def num_short(self) -> int:
        """Queued requests whose prompt is not long."""
        return len(self._lane_of) - self.num_long

    def is_long(self, request: Request) -> bool:
        """Whether ``request`` goes to a long lane."""
        return not request.kv_handoff and is_long_prompt(request, self._long_threshold)

    def effective_priority(self, request: Request, now: float) -> int:
        """Base priority minus one per full aging interval waited by ``now``."""
        if self._aging is None:
            return request.priority
        waited = max(0.0, now - request.arrival_time)
        return request.priority - math.floor(waited / self._aging)

    def add(self, request: Request) -> None:
        """Append ``request`` to the back of its lane."""
        self._insert(request, self._next_seq)
        self._next_seq += 1

    def prepend(self, request: Request) -> None:
        """Put ``request`` (a preempted one) at the front of its lane."""
        self._insert(request, self._front_seq)
        self._front_seq -= 1
        self._lanes[self._lane_of[request]].move_to_end(request, last=False)

    def _insert(self, request: Request, seq: int) -> None:
        if request in self._lane_of:
            raise ValueError(f"request {request.request_id!r} is already queued")
        key = (request.priority if self._by_priority else 0, self.is_long(request),
               request.kv_handoff)
        self._lanes.setdefault(key, OrderedDict())[request] = seq
        self._lane_of[request] = key
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_long += key[1]

    def remove(self, request: Request) -> None:
        """Take ``request`` out of the queue wherever it is."""
        key = self._lane_of.pop(request, None)
        if key is None:
            raise ValueError(f"request {request.request_id!r} is not queued")
        lane = self._lanes[key]
        del lane[request]
        if not lane:
            del self._lanes[key]
        self.num_prompt_tokens -= request.num_prompt_tokens
        self.num_long -= key[1]

    def peek(self) -> Request:
        """The first request in queue order (``IndexError`` when empty)."""
        request = next(self._ordered(), None)
        if request is None:
            raise IndexError("peek from an empty queue")
        return request

    def pop(self) -> Request:
        """Remove and return the first request in queue order."""
        request = self.peek()
        self.remove(request)
        return request

    def first_eligible(self, is_eligible: Callable[[Request], bool],
                       include_long: bool = True) -> Request | None:
        """The first request in queue order that ``is_eligible`` accepts (not
        removed); with ``include_long`` false the long lanes are skipped
        without looking at their requests."""
        return next((r for r in self._ordered(include_long) if is_eligible(r)), None)

    def _rank(self, request: Request, seq: int, now: float) -> tuple:
        # A lane holds handoffs only or none, so within a lane ranks only
        # grow and the merge below is exact.
        if not self._by_priority:
            return (not request.kv_handoff, seq)
        return (self.effective_priority(request, now), not request.kv_handoff,
                request.arrival_time, seq)

    def _ordered(self, include_long: bool = True) -> Iterator[Request]:
        # A k-way merge of the lanes. Sequence numbers are unique, so ranks
        # never tie and the heap never compares requests or iterators.
        now = self._clock()
        heap = []
        for key, lane in self._lanes.items():
            if key[1] and not include_long:
                continue
            items = iter(lane.items())
            request, seq = next(items)
            heap.append((self._rank(request, seq, now), request, items))
        heapq.heapify(heap)
        while heap:
            _, request, items = heap[0]
            yield request
            following = next(items, None)
            if following is None:
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (self._rank(*following, now), following[0], items))

    def __len__(self) -> int:
        return len(self._lane_of)

    def __iter__(self) -> Iterator[Request]:
        """Queued requests in queue order (do not mutate the queue meanwhile)."""
        return self._ordered()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on inconsistent bookkeeping (tests)."""
        assert all(self._lanes.values()), "empty lane kept"
        assert sum(map(len, self._lanes.values())) == len(self._lane_of)
        for key, lane in self._lanes.items():
            assert all(self._lane_of[r] == key for r in lane), "request in the wrong lane"
        assert self.num_long == sum(key[1] for key in self._lane_of.values())
        assert self.num_prompt_tokens == sum(r.num_prompt_tokens for r in self._lane_of)


def make_queue(policy: str, clock: Callable[[], float], aging_interval: float | None = None,
               long_threshold: int | None = None) -> LaneQueue:
    """The waiting queue for a scheduling policy (``fcfs`` or ``priority``)."""
    return LaneQueue(clock, by_priority=policy == "priority", aging_interval=aging_interval,
                     long_threshold=long_threshold)


class ExpiryQueue:
    """Waiting requests that carry a deadline or queue timeout, soonest first.

    Entries are never removed eagerly: a request that got scheduled,
    finished or aborted leaves a stale entry that is dropped when it
    reaches the top, or in a compaction once stale entries dominate, so
    each step costs O(1) when nothing expires.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Request]] = []
        self._seq = itertools.count()
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request, queue_timeout: float | None) -> None:
        """Track ``request`` if it has a deadline or a queue timeout applies.

        The earlier of the two wins; on a tie the reason is ``"deadline"``.
        """
        candidates = []
        if request.deadline is not None:
            candidates.append((request.deadline, 0, "deadline"))
        if queue_timeout is not None:
            candidates.append((request.arrival_time + queue_timeout, 1, "queue_timeout"))
        if candidates:
            expiry, _, reason = min(candidates)
            heapq.heappush(self._heap, (expiry, next(self._seq), reason, request))

    def pop_expired(self, now: float) -> list[tuple[Request, str]]:
        """Entries whose expiry time is strictly before ``now``, earliest first.

        The caller decides which are still waiting; the others are stale.
        """
        expired = []
        while self._heap and self._heap[0][0] < now:
            _, _, reason, request = heapq.heappop(self._heap)
            expired.append((request, reason))
        return expired

    def compact(self, is_live: Callable[[Request], bool]) -> None:
        """Drop stale entries when the heap has doubled since the last compaction.

        A compaction of n entries happens only after n/2 pushes, so the
        cost is amortised O(1) per request.
        """
        if len(self._heap) < self._compact_at:
            return
        self._heap = [entry for entry in self._heap if is_live(entry[3])]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))
