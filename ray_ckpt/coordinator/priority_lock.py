"""An asyncio lock that hands itself to the waiter of highest priority, not to the first to wait.

Why: the coordinator's peer replication sends one version's files at a time. With a save every
step and sends slower than a step, the waiters pile up; ``asyncio.Lock`` serves them oldest first,
so the newest version -- the one a restore would read -- waits behind versions that the newest will
supersede, and a preemption notice's copy of the newest version waits behind all of them
(``benchmarks/goodput.py``'s every-step arm lost a version that committed during a notice this
way). Here each waiter gives a priority (a tuple: larger is served first; equal priorities in
arrival order).

Plain asyncio, no Ray: unit-tested in tests/test_peer_replicas.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from typing import AsyncIterator, List, Tuple


class PriorityLock:
    """``async with lock.hold(priority): ...``; one holder at a time. On release the lock passes
    straight to the waiting holder of the highest priority."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: List[Tuple[Tuple, int, asyncio.Future]] = []  # (negated priority, arrival, future)
        self._arrival = itertools.count()

    @property
    def locked(self) -> bool:
        return self._held

    @contextlib.asynccontextmanager
    async def hold(self, priority: Tuple) -> AsyncIterator[None]:
        if self._held:
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (tuple(-p for p in priority), next(self._arrival), fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # handed over as this waiter was cancelled: pass it on
                    self._release()
                raise
        else:
            self._held = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():  # a cancelled waiter's future is done: skipped
                fut.set_result(None)  # the lock stays held: it is that waiter's now
                return
        self._held = False
