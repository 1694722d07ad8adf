"""Ranks' pushes travel to the coordinator in batches: one call per engine and version, not per part.

Why: a host process pushes for hundreds of ranks (ranks share nodes, hence processes). With one
``coordinator.submit`` call per part, at thousands of parts per version Ray's own work on each
incoming call (argument deserialisation, the hand-off to the actor's event loop, the reply) would be
the coordinator's largest cost, and the queries (``list_checkpoints()``) would wait behind them.

``engine.submit()`` still validates at the call and returns a handle at once; its part joins the
*open batch* of its version (:class:`PushBatch`). A batch is sent as ONE
``coordinator.submit_parts(version, parts)`` call when the first of:

- ``PUSH_WINDOW_S`` passed since its first part AND this engine's previous call was answered (a
  small background thread per engine, the *flusher*, sends it). At most one call is in flight per
  engine: while the coordinator works on one, the next batch grows, so the number of calls adapts
  to how busy the coordinator is (a host pushing hundreds of ranks to a busy coordinator sends
  tens of parts per call; a rank actor pushing its two states sends them in one). The previous
  answer is awaited at most ``PUSH_MAX_WAIT_S``;
- it holds ``PUSH_BATCH_MAX`` parts;
- (not while a ``held()`` block of the engine is open: its parts go when it ends, see there)
- a handle needs its answer (``wait()``, ``result()``, ``done()``) or the engine's backpressure
  needs its commit, or the engine shuts down (:meth:`Pusher.send_all`).

A part may come with its object instead of its ref (``add(..., put=obj)``: an overlapped
snapshot's small ``PendingSnapshot``, or a small state whose bytes ``submit`` already copied): the
sender puts it into the object store just before the call, so ``submit`` does not wait for the
store's round trip (several ms on a loaded host, per part). A put that fails there fails the batch's
handles with its error.

The coordinator answers with a :class:`SubmitBatchResult`: which entries it refused and why (pushed
twice, rank out of range on its side, version already committed), so a bad entry fails only its
own rank's handle, with the same message a call of its own would have raised. Right after the
batch, the flusher asks for the version's commit with the process's shared wait call
(``handle.shared_wait``): after the parts, as before, so the wait of a version that failed before
and is pushed again sees the new attempt.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import ray

from ..errors import SaveError
from ..protocol import PushedPart, SubmitBatchResult

PUSH_WINDOW_S = 0.005   # a batch waits this long for more parts of its version ...
PUSH_MAX_WAIT_S = 1.0   # ... and for the answer to this engine's previous call, at most this long
PUSH_BATCH_MAX = 4096  # parts per submit_parts call at most


class PushBatch:
    """One version's parts pushed by one engine within one window; becomes one coordinator call."""

    def __init__(self, version: int):
        self.version = version
        self.parts: List[PushedPart] = []
        self.opened_at = time.monotonic()
        self.sent = False
        self.ack: Optional[ray.ObjectRef] = None      # the call's SubmitBatchResult
        self.commit: Optional[ray.ObjectRef] = None   # the version's shared wait (see handle.shared_wait)
        self.error: Optional[str] = None              # the call could not even be made
        self.later: Dict[int, Any] = {}                # index -> object the sender puts (see the module)


class PushSlot:
    """A handle's place in a batch: its part's answer and its version's commit, sending the batch
    first if it is still open (a handle that needs an answer does not wait for the window)."""

    __slots__ = ("pusher", "batch", "index")

    def __init__(self, pusher: "Pusher", batch: PushBatch, index: int):
        self.pusher, self.batch, self.index = pusher, batch, index

    def _sent(self) -> PushBatch:
        if not self.batch.sent:
            self.pusher.send_all()
        if self.batch.error is not None:
            raise SaveError(self.batch.error)
        return self.batch

    def commit_ref(self) -> ray.ObjectRef:
        return self._sent().commit

    def ack_ref(self) -> ray.ObjectRef:
        return self._sent().ack

    def ready(self) -> bool:
        """Whether the coordinator answered this part's batch (never blocks; sends it if open)."""
        try:
            return bool(ray.wait([self.ack_ref()], timeout=0)[0])
        except SaveError:
            return True

    def wait_answered(self) -> None:
        """Block until the coordinator answered this part's batch (or the call failed)."""
        try:
            ray.wait([self.ack_ref()], num_returns=1, timeout=None)
        except SaveError:
            pass

    def check(self, timeout: Optional[float]) -> None:
        """Raise SaveError if the coordinator refused this part (waits up to ``timeout`` for the
        answer: ray's GetTimeoutError past it; Ray's errors if the call itself failed)."""
        result: SubmitBatchResult = ray.get(self.ack_ref(), timeout=timeout)
        why = result.rejected.get(self.index)
        if why is not None:
            raise SaveError(why)


class Pusher:
    """An engine's open batches and the flusher thread that sends them (started at the first push)."""

    def __init__(self, coordinator: Callable[[], Any], shared_wait: Callable[[Any, int], ray.ObjectRef],
                 window_s: float = PUSH_WINDOW_S, max_wait_s: float = PUSH_MAX_WAIT_S,
                 max_parts: int = PUSH_BATCH_MAX):
        self._coordinator = coordinator  # the engine's current coordinator handle (it may be revived)
        self._shared_wait = shared_wait
        self.window_s, self.max_wait_s, self.max_parts = window_s, max_wait_s, max_parts
        self._last_ack: Optional[ray.ObjectRef] = None  # this engine's latest submit_parts call
        self.calls = 0  # submit_parts calls made (benchmarks/scale.py reports parts per call)
        self._open: Dict[int, PushBatch] = {}
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()  # batches leave in the order they were closed
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._holds = 0  # open held() blocks: the flusher waits for them to end
        self.commits: Dict[int, ray.ObjectRef] = {}  # version -> its shared wait, while in flight here

    def add(self, version: int, part: PushedPart, put: Any = None) -> PushSlot:
        """Join ``part`` to its version's open batch; ``put``: the object the sender puts into the
        object store for it (``part.ref`` None), see the module."""
        with self._cond:
            batch = self._open.get(version)
            if batch is None:
                batch = self._open[version] = PushBatch(version)
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(target=self._flusher, name="ray_ckpt-push-flusher",
                                                    daemon=True)
                    self._thread.start()
                self._cond.notify()  # a new batch: the flusher times its window (not woken per part)
            batch.parts.append(part)
            if put is not None:
                batch.later[len(batch.parts) - 1] = put
            slot = PushSlot(self, batch, len(batch.parts) - 1)
            full = len(batch.parts) >= self.max_parts
        if full:
            self.send_all()
        return slot

    @contextlib.contextmanager
    def held(self):
        """The flusher sends nothing until the block ends (then at once if the window has passed):
        parts pushed together go in one call, and the coordinator and the writers it wakes do not
        take the cores while the pushing thread is still capturing. A handle that needs its answer
        inside the block still sends at once (``send_all``)."""
        with self._cond:
            self._holds += 1
        try:
            yield self
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify()

    def pending_versions(self) -> List[int]:
        """Versions with parts not sent yet."""
        with self._cond:
            return list(self._open)

    def send_all(self) -> None:
        """Send every open batch now, oldest version first."""
        with self._send_lock:
            with self._cond:
                batches = [self._open.pop(v) for v in sorted(self._open)]
            for b in batches:
                self._send(b)

    def _send(self, batch: PushBatch) -> None:
        later, batch.later = batch.later, {}
        for i, obj in later.items():
            part = batch.parts[i]
            try:
                batch.parts[i] = part._replace(ref=ray.put(obj))
            except Exception as exc:  # e.g. the object store is full: this engine's parts of the version fail
                batch.error = f"state {part.name!r} rank {part.rank}: its snapshot could not be put into the object " \
                              f"store: {exc}"
                batch.sent = True
                return
        coord = self._coordinator()
        try:
            batch.ack = self._last_ack = coord.submit_parts.remote(batch.version, batch.parts)
            self.calls += 1
            commit = self.commits.get(batch.version)
            if commit is None:  # this engine's first push of the version: a new attempt, if it ran before
                commit = self.commits[batch.version] = self._shared_wait(coord, batch.version)
            batch.commit = commit
        except Exception as exc:  # e.g. the coordinator's handle is unusable: every part of it fails
            batch.error = f"the push of {len(batch.parts)} part(s) of version {batch.version} could not be " \
                          f"sent to the coordinator: {exc}"
        batch.sent = True

    def _flusher(self) -> None:
        while True:
            with self._cond:
                while (not self._open or self._holds) and not self._closed:
                    self._cond.wait()
                if self._closed and not self._open:
                    return
                due = min(b.opened_at for b in self._open.values()) + self.window_s
                left = due - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
            previous = self._last_ack
            if previous is not None:  # parts gather while the coordinator works on the previous call
                try:
                    ray.wait([previous], timeout=self.max_wait_s)
                except Exception:  # Ray shutting down: send anyway, the call reports it
                    pass
            self.send_all()

    def close(self) -> None:
        """Send what is open and stop the flusher (the engine shuts down)."""
        self.send_all()
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
