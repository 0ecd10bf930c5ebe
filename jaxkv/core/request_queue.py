"""The scheduler's waiting queue for each scheduling policy (vLLM ``vllm/v1/core/sched/request_queue.py``).

* ``"fcfs"``: arrival order; a preempted request goes back to the front (:class:`FCFSQueue`, a ``deque``);
* ``"priority"``: by ``(request.priority, request.arrival_index)``, smaller first, also for a preempted request
  (:class:`PriorityQueue`).

Both offer the ``deque`` operations the scheduler uses: ``append`` (a new request), ``appendleft`` (a preempted
one), ``[0]``, ``popleft``, ``remove``, ``in``, ``len``, iteration in admission order.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator

from jaxkv.config import SCHEDULING_POLICIES


class FCFSQueue(collections.deque):
    """First come, first served (vLLM ``FCFSRequestQueue``)."""


class PriorityQueue:
    """Requests kept sorted by ``(priority, arrival_index)`` (vLLM ``PriorityRequestQueue``: lower priority values
    first, ties by arrival). A list with binary insertion: the head is read every pass, inserts are rare."""

    def __init__(self):
        self._reqs: list = []

    @staticmethod
    def _key(req) -> tuple[int, int]:
        return req.priority, req.arrival_index

    def append(self, req) -> None:
        self._reqs.insert(bisect.bisect_right(self._reqs, self._key(req), key=self._key), req)

    appendleft = append  # a preempted request goes back by its priority, not to the front

    def popleft(self):
        return self._reqs.pop(0)

    def remove(self, req) -> None:
        self._reqs.remove(req)  # ValueError when absent, as deque.remove

    def __getitem__(self, i: int):
        return self._reqs[i]

    def __contains__(self, req) -> bool:
        return req in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator:
        return iter(self._reqs)


def make_waiting_queue(policy: str):
    """The waiting queue of ``policy``.

    Raises:
        ValueError: ``policy`` not one of :data:`SCHEDULING_POLICIES`.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy={policy!r} is not one of {SCHEDULING_POLICIES}")
