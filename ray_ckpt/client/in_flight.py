"""The engine's saves in flight: backpressure before a save, forgetting the ones that ended while
keeping their failures, and waiting for all of them.

A mixin of :class:`~ray_ckpt.client.engine.CheckpointEngine` (the state it uses -- ``_in_flight``,
``_ended_failures``, ``config`` -- is set up by the engine's ``__init__``), kept apart so the engine
module holds the public API and this one the bookkeeping of handles that ``save()``,
``submit()`` and ``wait_until_finished()`` share.
"""
from __future__ import annotations

import time
from typing import Callable, Deque, List, Optional

import ray

from ..config import EngineConfig
from ..errors import SaveError, SaveTimeoutError, one_line
from ..types import OnBusy, SaveResult
from .handle import SaveHandle


class InFlightSaves:
    """The handles this engine issued and not yet forgotten (see the module)."""

    config: EngineConfig
    _in_flight: List[SaveHandle]
    _ended_failures: Deque[BaseException]

    def _make_room(self, policy: OnBusy) -> bool:
        """Apply ``max_in_flight`` before a save: False when this save is to be skipped
        (``OnBusy.SKIP`` with the limit reached); with ``OnBusy.WAIT`` block until enough ended."""
        self._drop_ended(lambda h: not h.done())
        if len(self._in_flight) >= self.config.max_in_flight:
            if policy is OnBusy.SKIP:
                return False
            if policy is OnBusy.WAIT:
                ray.wait([h._ref for h in self._in_flight], num_returns=len(self._in_flight)
                         - self.config.max_in_flight + 1)
                self._drop_ended(lambda h: not h.done())
        return True

    def _wait_in_flight(self, timeout: Optional[float]) -> List[SaveResult]:
        """``wait_until_finished()``'s work: wait for every handle (``timeout`` bounds the whole
        wait), forget them all, and raise the first failure among them and those that ended before."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results, failures = [], list(self._ended_failures)
        self._ended_failures.clear()
        for h in [h for h in self._in_flight if not h.skipped]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(h.wait(left))
            except SaveTimeoutError:
                raise
            except SaveError as exc:
                failures.append(exc)
        self._in_flight = []
        if failures:
            raise failures[0]
        return results

    def _drop_ended(self, keep: Callable[[SaveHandle], bool]) -> None:
        """Forget the handles ``keep`` rejects (ended saves), remembering their failures for
        ``wait_until_finished()``; a version's handles in this process share one commit, so one
        of them is asked (and each whose push was refused on its own)."""
        kept, asked = [], set()
        for h in self._in_flight:
            if keep(h):
                kept.append(h)
            elif not h.skipped and (h.version not in asked or h._ack_failed()):
                asked.add(h.version)
                exc = h.exception(timeout=0)
                if exc is not None:  # a copy without the traceback, whose frames hold the handle's snapshot refs
                    self._ended_failures.append(_detached(exc))
        self._in_flight = kept


def _detached(exc: BaseException) -> BaseException:
    """The same error, holding no traceback or chained error (nothing that keeps objects alive)."""
    try:
        return type(exc)(*exc.args)
    except Exception:
        return SaveError(one_line(exc))

