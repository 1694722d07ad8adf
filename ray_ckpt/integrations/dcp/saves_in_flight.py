"""One ``rc.dcp.writer`` save at a time in a process: a new writer waits (bounded) for the saves
this process still runs.

Why: a DCP save runs collectives (plans gathered and scattered, results gathered, the outcome
broadcast) on its process group. Two saves of one process at the same time -- a second
``dcp.async_save`` before the first's ``.result()`` -- issue their collectives from two threads,
in an order that differs between ranks, and both hang for good (gloo pairs collectives by their
order). ``rc.dcp.writer`` therefore waits, before the next save starts, until every save this
process started through it has ended, and raises a ``SaveTimeoutError`` naming the step still
running when its ``timeout`` passes first: the caller gets an error, never a silent hang.

A save has started when DCP first calls its writer (``set_up_storage_writer``, on the thread that
runs the save) and ended when its ``write_data`` returned or one of its callbacks raised; after
that DCP still gathers the results and broadcasts the outcome on the save's thread, which
``dcp.async_save``'s executor ends with the save: the wait joins it (a few seconds at most, for a
thread that lives on). A writer DCP has not called within ``START_GRACE`` seconds of the wait is
not a save in flight (made and never used, or its save failed before DCP called it).
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Optional

from ...errors import SaveTimeoutError

__all__ = ["SaveInFlight", "wait_for_earlier_saves"]

START_GRACE = 5.0  # seconds a writer made before the wait may take to be called by DCP (async_save's thread start)
TAIL_GRACE = 5.0  # seconds the wait gives the thread of an ended save for DCP's last collectives

_lock = threading.Lock()
_saves: "weakref.WeakSet[SaveInFlight]" = weakref.WeakSet()


class SaveInFlight:
    """The in-flight state of one writer's save; the writer calls :meth:`started` from its first
    DCP callback and :meth:`ended` when its ``write_data`` returns or a callback raises."""

    step: int
    run: str

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._ended = threading.Event()
        with _lock:
            _saves.add(self)

    def started(self) -> None:
        if not self._started.is_set():
            self._thread = threading.current_thread()
            self._started.set()

    def ended(self) -> None:
        self._ended.set()


def _drop(save: Any) -> None:
    with _lock:
        _saves.discard(save)


def wait_for_earlier_saves(timeout: float, new_step: int) -> None:
    """Block until every ``rc.dcp.writer`` save of this process has ended, at most ``timeout``
    seconds in all; a ``SaveTimeoutError`` naming the save still running when it passes."""
    deadline = time.monotonic() + timeout
    me = threading.current_thread()
    with _lock:
        pending = sorted(_saves, key=lambda s: s.step)
    for save in pending:
        left = max(0.0, deadline - time.monotonic())
        if not save._started.wait(min(START_GRACE, left)):
            if left > START_GRACE:  # never called by DCP: not a save in flight
                _drop(save)
                continue
        elif save._thread is me:  # started on this thread: a dcp.save here that has returned
            _drop(save)
            continue
        elif save._ended.wait(max(0.0, deadline - time.monotonic())):
            thread = save._thread
            if thread is not None:
                thread.join(min(TAIL_GRACE, max(0.0, deadline - time.monotonic())))
            _drop(save)
            continue
        raise SaveTimeoutError(
            f"rc.dcp.writer: step {new_step} of run {save.run!r} cannot start: the save of step {save.step} "
            f"(started by dcp.async_save or another thread of this process) has not ended after {timeout:g}s. "
            f"Two saves at once, or a save and training collectives on the same process group, interleave "
            f"their collectives and hang: wait for each dcp.async_save's .result() before the next save, and "
            f"give async_save its own group (process_group=torch.distributed.new_group(backend='gloo')) when "
            f"training goes on during the save")
