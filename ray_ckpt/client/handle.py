"""SaveHandle: the future of one save, and the wait calls handles share.

A handle *is* a ``concurrent.futures.Future`` (``result``, ``done``, ``exception``,
``add_done_callback``, ``concurrent.futures.wait`` / ``as_completed``, awaitable); ``wait()`` is the form that also waits for the remote tier or
for best-effort parts. A rank's push is acknowledged at once by the coordinator; the handles of one
process share one ``wait`` call per version (``shared_wait``), so thousands of ranks cost the
coordinator a few calls, not one each.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import ray

from ..errors import InvalidArgumentError, SaveError, SaveTimeoutError, one_line
from ..ray_internals import actor_id_hex
from ..types import SaveResult

if TYPE_CHECKING:
    from .push_batch import PushSlot

_WAITS: "OrderedDict[tuple, ray.ObjectRef]" = OrderedDict()  # see shared_wait
_WAITS_LOCK = threading.Lock()
_WAITS_MAX = 4096


def shared_wait(coord: Any, version: int, durability: str = "local", best_effort: bool = False,
                 pushed: bool = True, fresh: bool = False) -> ray.ObjectRef:
    """ONE ``coordinator.wait(version, durability)`` call per (coordinator, version, durability) in
    this process, shared by every handle that waits on it: a host process pushing 300 ranks costs
    the coordinator one waiting call per version, not 300. (Waiting calls are coroutines in the
    coordinator; they hold no slot the parts need, but thousands of them would still be thousands
    of calls.) ``fresh``: a new push for ``version`` — a cached call that already ended (the
    version committed or failed before) is replaced, since the push starts a new attempt."""
    key = (actor_id_hex(coord), version, durability, best_effort, pushed)
    with _WAITS_LOCK:
        ref = _WAITS.get(key)
        if ref is not None and fresh and ray.wait([ref], timeout=0)[0]:
            ref = None
        if ref is None:
            ref = coord.wait.remote(version, durability, best_effort, pushed)
            _WAITS[key] = ref
            while len(_WAITS) > _WAITS_MAX:
                _WAITS.popitem(last=False)
        else:
            _WAITS.move_to_end(key)
        return ref


_PENDING, _FINISHED = "PENDING", "FINISHED"  # concurrent.futures' state names


class SaveHandle(concurrent.futures.Future):
    """The future of one save. ``wait()`` raises SaveError on failure: never silent.

    A ``concurrent.futures.Future``: ``result(timeout)`` (``SaveTimeoutError``, a ``TimeoutError``,
    when time runs out), ``done()``, ``exception()``, ``add_done_callback(fn)``, ``cancel()``, and
    ``concurrent.futures.wait`` / ``as_completed`` take handles; ``await handle`` in asyncio code.
    ``wait()`` is the form that also waits for the remote tier (``durability="remote"``) or for
    best-effort parts.

    The base class's state is settled lazily: the answers above ask Ray directly, and only
    ``concurrent.futures``' own functions (which read the state under the future's lock) or
    ``add_done_callback`` start a watcher, so thousands of rank handles cost no thread each.

    A rank's handle (``submit()``) holds its place in a batch of pushed parts (``_push``, see
    ``push_batch.py``): the coordinator's answer for the batch (a refused part raises its own
    error) and ``_ref``, the version's commit, shared with every other handle of this process
    waiting on the same version (``shared_wait``). Asking for either sends the batch if it is
    still open."""

    # engine: the CheckpointEngine that made it (not imported here: the engine imports this module)
    def __init__(self, engine: Any, step: int, ref: Optional[ray.ObjectRef],
                 submit_s: float, skipped: bool = False, push: Optional["PushSlot"] = None,
                 rank_zero_only: bool = False):
        self._watching = False
        super().__init__()
        self._engine = engine
        self._coordinator = engine._coordinator  # the one this save went to
        self.step = step
        self.version: Optional[int] = None if skipped else step
        self._commit_ref = ref
        self._push = push
        self._rank_zero_only = rank_zero_only
        self._remote_ref = None
        self.submit_seconds = submit_s  # how long save() took to return
        self.skipped = skipped
        self._snapshots: Dict[str, Tuple[Any, bool]] = {}  # state -> (snapshot ref or inline snapshot, overlapped)
        self._released = False  # release_snapshots() was called
        if skipped:
            self._watching = True
            concurrent.futures.Future.set_result(self, SaveResult(None, step, 0, "skipped"))

    # concurrent.futures.wait / as_completed read ``_state`` under ``_condition``: reading it is what
    # tells a handle that someone waits on the base class, so it starts settling then
    @property
    def _state(self) -> str:
        state = self.__dict__["_future_state"]
        if state == _PENDING and not self._watching:
            self._watch()
            state = self.__dict__["_future_state"]
        return state

    @_state.setter
    def _state(self, value: str) -> None:
        self.__dict__["_future_state"] = value

    def _watch(self) -> None:
        """Settle the base class's state: at once if the save already ended, else from a thread
        that waits for it (the local commit, as ``result()``)."""
        self._watching = True
        if self.done():
            self._settle()
        else:
            threading.Thread(target=self._settle, name=f"ray_ckpt-done-{self.step}", daemon=True).start()

    def _settle(self) -> None:
        try:
            outcome: Any = self.wait()
        except BaseException as exc:  # noqa: BLE001 - the future carries whatever the save raised
            outcome = exc
        try:
            if isinstance(outcome, BaseException):
                concurrent.futures.Future.set_exception(self, outcome)
            else:
                concurrent.futures.Future.set_result(self, outcome)
        except concurrent.futures.InvalidStateError:
            pass  # settled by another path first

    @property
    def _ref(self) -> Optional[ray.ObjectRef]:
        """The version's commit (a pushed part's: its batch sent first if still open)."""
        if self._push is not None:
            try:
                return self._push.commit_ref()
            except SaveError:  # the batch could not be sent: its ack says so
                return self._push.batch.ack
        return self._commit_ref

    def _ack_failed(self) -> bool:
        """Whether a rank's push was rejected (only once its ack arrived; never blocks)."""
        if self._push is None or not self._push.ready():
            return False
        try:
            self._push.check(0)
        except Exception:
            return True
        return False

    def _coordinator_died(self) -> bool:
        """Whether this (finished) save failed because its coordinator died for good."""
        try:
            ray.get(self._ref, timeout=0)
        except ray.exceptions.ActorDiedError:
            return self._engine._coordinator is self._coordinator
        except Exception:
            pass
        return False

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"SaveHandle(step={self.step}, {state})"

    def done(self) -> bool:
        """True once the local commit finished (or failed, or the push was rejected); never blocks."""
        if self._push is not None:
            if not self._push.ready():
                return False
            if self._ack_failed():
                return True
        if self._ref is None:
            return True
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: Optional[float] = None, durability: str = "local",
             best_effort: bool = False, progress: bool = False) -> SaveResult:
        """Block until the version is committed on the ``durability`` tier: "local", "replicated"
        (local, and every critical file held in the memory of the run's ``peer_replicas`` other
        nodes) or "remote".

        ``best_effort=True`` also waits for the version's best-effort parts to be written or
        reported missing (a commit never waits for them). ``progress=True`` with
        ``durability="remote"`` shows the upload on stderr as it goes (``step 100 upload:
        1.2 GiB / 3.4 GiB (35%), 80 MiB/s, 27s left``), as the CLI shows its long work."""
        if self.skipped:
            return SaveResult(None, self.step, 0, "skipped")
        if durability not in ("local", "replicated", "remote"):
            raise InvalidArgumentError(f"durability must be 'local', 'replicated' or 'remote', got {durability!r}")
        coord = self._engine._coordinator
        pushed = self._push is not None
        if best_effort:
            ref = shared_wait(coord, self.version, durability, True, pushed) if pushed else \
                coord.wait.remote(self.version, durability, True)
        elif durability == "local":
            ref = self._ref
        elif durability == "replicated":
            ref = shared_wait(coord, self.version, "replicated", pushed=pushed) if pushed else \
                coord.wait.remote(self.version, "replicated")
        else:
            if self._remote_ref is None:
                self._remote_ref = shared_wait(coord, self.version, "remote", pushed=pushed) if pushed else \
                    coord.wait.remote(self.version, "remote")
            ref = self._remote_ref
        try:
            if self._push is not None:  # a rejected push raises its own error, not the version's
                t0 = time.monotonic()
                self._push.check(timeout)
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - t0))
            if progress and durability == "remote":
                t0 = time.monotonic()
                _show_upload(coord, self.version, ref, timeout)
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - t0))
            d = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            detail = ""
            if durability == "remote":
                try:
                    err = ray.get(coord.remote_error.remote(self.version), timeout=10)
                    detail = f"; last upload error: {err}" if err else "; upload still in progress"
                except Exception:
                    pass
            raise SaveTimeoutError(f"step {self.step} of run {self._engine.run!r} is not durable on the "
                                   f"{durability} tier after {timeout}s{detail}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            revived = isinstance(exc, ray.exceptions.ActorDiedError) and (
                self._engine._coordinator is not self._coordinator or self._engine._revive())
            raise SaveError(f"the coordinator of run {self._engine.run!r} died while step {self.step} was in "
                            f"flight; its outcome is lost (listed only if its manifest was written before) "
                            f"({one_line(exc)[:200]})"
                            + ("; a new coordinator was created: later saves go to it" if revived else "")) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise (type(cause) if isinstance(cause, SaveError) else SaveError)(one_line(cause)) from None
        if self._rank_zero_only:  # a replica rank's push: rank 0's copy is the one stored
            d = dataclasses.replace(d, rank_zero_only=True)
        return d.result()

    # ------------------------------------------------------------------ the snapshot's bytes, for broadcasting
    def release_snapshots(self) -> None:
        """Drop this handle's references to its snapshots (``refs()`` raises afterwards). For a
        caller that keeps the handles of finished saves (the RLlib callback keeps one per version):
        a kept handle otherwise keeps its small snapshots' objects in this process and its larger
        ones pinned in the object store, one more set per save for the whole run."""
        self._snapshots = {}
        self._released = True

    def refs(self, name: str, timeout: Optional[float] = 60.0) -> List[ray.ObjectRef]:
        """The ObjectRefs of state ``name``'s snapshot in Ray's object store (one per part), to hand
        to rollout actors instead of copying the weights a second time: a consumer on the same node
        maps the same bytes (zero-copy); ``rc.state_from_snapshot(ref)`` turns one into the state.

        For an overlapped state this waits (up to ``timeout``) for its background copy, and raises
        SaveError if that copy failed. The refs stay valid while someone holds them, whatever
        becomes of the version (they are the step's bytes, not the committed files); ask for them
        before the next save of the state (an overlapped state's run keeps only its newest refs)."""
        entry = self._snapshots.get(name)
        if entry is None and self._released:
            raise InvalidArgumentError(f"save of step {self.step}: its snapshots were released "
                                       f"(release_snapshots(), e.g. by the RLlib callback once the save ended)")
        if entry is None:
            raise InvalidArgumentError(
                f"save of step {self.step} has no snapshot of state {name!r} taken by the driver"
                + (f" (it has: {', '.join(sorted(self._snapshots))})" if self._snapshots else
                   " (a skipped save, or only states pushed by ranks)"))
        ref, overlapped = entry
        if not overlapped:  # a small snapshot came inline (capture.calls._sendable): it gets its ref now
            return [ref if isinstance(ref, ray.ObjectRef) else ray.put(ref)]
        from ..capture.mailbox import pending_refs

        try:
            pending = ray.get(ref, timeout=timeout) if isinstance(ref, ray.ObjectRef) else ref
        except ray.exceptions.GetTimeoutError:
            raise SaveError(f"the snapshot of state {name!r} (step {self.step}) did not start within {timeout}s "
                            f"(its provider is busy)") from None
        except ray.exceptions.RayError as exc:
            raise SaveError(f"the snapshot of state {name!r} (step {self.step}) failed: {one_line(exc)[:300]}") from None
        return pending_refs(pending, 600.0 if timeout is None else timeout)

    # ------------------------------------------------------------------ concurrent.futures.Future style
    def result(self, timeout: Optional[float] = None) -> SaveResult:
        """The local commit's SaveResult (as ``wait(timeout)``); raises SaveError on failure."""
        return self.wait(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The error the save failed with, or None once it committed (waits up to ``timeout``)."""
        try:
            self.wait(timeout)
        except SaveTimeoutError:
            raise
        except SaveError as exc:
            return exc
        return None

    def cancel(self) -> bool:
        """False: a save is dispatched when ``save()`` returns, and a dispatched save is not
        cancelled (as ``concurrent.futures.Future.cancel`` on a running future)."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        """True while the save is in flight."""
        return not self.skipped and not self.done()

    def add_done_callback(self, fn: Callable[["SaveHandle"], Any]) -> None:
        """Call ``fn(handle)`` once the local commit finished or failed (at once if it has); from a
        background thread, as ``concurrent.futures`` does for a future that is not done yet."""
        if not self._watching:
            self._watch()
        concurrent.futures.Future.add_done_callback(self, fn)

    def __await__(self):
        import asyncio

        return asyncio.get_event_loop().run_in_executor(None, self.wait).__await__()


def _show_upload(coord: Any, version: int, ref: Any, timeout: Optional[float], every: float = 1.0) -> None:
    """Show the upload of ``version`` (``coordinator.upload_progress``), labelled by its step (a
    save's version is its step), until ``ref`` (its remote wait) is ready or ``timeout`` passes; the
    caller then takes the result or the timeout error."""
    from .progress import Progress

    deadline = None if timeout is None else time.monotonic() + timeout
    bar: Optional[Progress] = None
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait([ref], timeout=every if left is None else min(every, left))
        try:
            now = ray.get(coord.upload_progress.remote(version), timeout=10)
        except Exception:  # the coordinator is busy or gone: the wait itself reports that
            now = None
        if now is not None and now[1] > 0:
            if bar is None or bar.total != now[1]:  # a retried attempt starts over
                if bar is not None:
                    bar.finish()
                bar = Progress(now[1], True, f"step {version} upload")
            if now[0] > bar.done:
                bar.add(now[0] - bar.done)
        if ready or left == 0.0:
            break
    if bar is not None:
        bar.finish()
