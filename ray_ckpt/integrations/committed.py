"""What the framework integrations share about committed versions: the small files written next to
a framework's checkpoint folders when a version commits (ray_ckpt's pointer, ``ray_ckpt.json``:
which run and step the folder stands for; the framework's own "latest" marker), each replaced
atomically so a reader never sees half a file, the background wait for each save's commit, and the
wait of a load for a step still in flight, and what a resumed run does with a step it used for a
version lost since (:class:`UsedSteps`, :func:`step_lost`, :func:`newest_committed_pointer`,
:func:`drop_lost_pointer`).

Used by the verl, OpenRLHF, SkyRL and Ray Train integrations (their ``tracker.py`` modules add what
their framework reads). No framework import here."""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import CheckpointError, RestoreError, SaveTimeoutError

POINTER = "ray_ckpt.json"
LOCK = threading.Lock()  # one process's commit callbacks (threads) write one file at a time


def atomic_write(path: str, text: str) -> None:
    """``text`` into ``path``: written to a temporary name, fsynced, then renamed over it."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_pointer(folder: str, pointer: Dict[str, Any]) -> str:
    """Write the pointer of a committed version into ``folder``; returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, POINTER)
    with LOCK:
        atomic_write(path, json.dumps(pointer, indent=1, sort_keys=True) + "\n")
    return path


def read_pointer(folder: str) -> Optional[Dict[str, Any]]:
    """The pointer in ``folder``, or None when the folder holds no committed ray_ckpt version."""
    path = os.path.join(folder, POINTER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_step_file(path: str) -> Optional[int]:
    """The step a framework's tracker file names (one integer), or None (no file, or not a number)."""
    try:
        with open(path, "rb") as f:
            return int(f.read().decode().strip())
    except (OSError, ValueError):
        return None


def error_line(exc: BaseException) -> str:
    """An error as one bounded line, its type first (what a framework's log and raise show)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]


def watch_saves(jobs: "queue.Queue[Any]", on_commit: Callable[[Any, List[Any]], None],
                describe: Callable[[Any], str], record_failure: Callable[[str], None], lock: Any,
                logger: logging.Logger) -> None:
    """A background thread's loop: each save taken from ``jobs`` (in order; it has ``handles``, a
    ``done`` event and an ``error``) is waited for, then ``on_commit(save, results)`` runs. A
    failure sets ``save.error``, is logged to ``logger`` and handed to ``record_failure`` (under
    ``lock``) for the framework's next save or load to raise. ``save.done`` is set either way.
    Never returns."""
    while True:
        save = jobs.get()
        try:
            on_commit(save, [h.wait() for h in save.handles])
        except Exception as exc:
            save.error = error_line(exc)
            what = describe(save)
            with lock:
                record_failure(f"the save of {what} failed: {save.error}")
            logger.error("ray_ckpt: the save of %s failed: %s", what, save.error)
        finally:
            save.done.set()


def time_left(deadline: Optional[float]) -> Optional[float]:
    """Seconds until ``deadline`` (a ``time.monotonic()`` time; None: no bound), never negative."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait_done(save: Any, deadline: Optional[float], timeout: Optional[float], what: str) -> None:
    """Wait until ``save.done`` is set (its commit watched by :func:`watch_saves`), at most until
    ``deadline``; a ``SaveTimeoutError`` naming ``what`` and ``timeout`` otherwise."""
    if not save.done.wait(time_left(deadline)):
        raise SaveTimeoutError(f"ray_ckpt: the save of {what} has not committed after {timeout}s")


def broadcast_error(error: Optional[str], world_size: int, kind: type = CheckpointError) -> None:
    """Rank 0's error (or None) to every rank of the torch.distributed group; every rank raises it,
    so no rank waits forever in a collective the others left (``kind``: the error's class)."""
    if world_size > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise kind(error)


def rank0_decides(value: Any, world_size: int) -> Any:
    """Rank 0's ``value`` on every rank of the torch.distributed group (one small collective): what
    all ranks must agree on, such as whether this step is saved."""
    if world_size > 1:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def wait_committed(engine: Any, run: str, step: int, load_wait_s: float) -> float:
    """Return (the seconds waited) once ``step`` of ``engine``'s run is committed. A step still in
    flight is waited for, up to ``load_wait_s``; one neither committed nor in flight (after a short
    grace: a rank's push may still be on its way) is a RestoreError naming it."""
    start = time.monotonic()
    deadline = start + load_wait_s
    grace = start + min(2.0, load_wait_s)
    pause = 0.05
    while True:
        committed = engine.all_steps()
        if step in committed:
            return time.monotonic() - start
        in_flight = {d.get("step") for d in engine.status().get("in_flight", {}).values()}
        now = time.monotonic()
        if step not in in_flight and now >= grace:
            raise RestoreError(f"step {step} of ray_ckpt run {run!r} never committed (not in flight either); "
                               f"committed steps: {committed[-8:] or 'none'}")
        if now >= deadline:
            raise RestoreError(f"step {step} of ray_ckpt run {run!r} is still being written after {load_wait_s}s "
                               f"(load_wait_s); committed steps: {committed[-8:]}")
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(pause * 2, 1.0)


# ---------------------------------------------------------------- steps of versions lost with a node
class UsedSteps:
    """Whether a framework's step may still be saved. A run never uses a step twice: a version lost
    with its node (a preemption whose deadline it missed, a node removed at once) is no longer
    listed (``engine.skipped_versions()``), and no step up to it that is not committed is used
    again. A run restored from the version before it redoes those steps, and its framework asks to
    save them again: the coordinator would refuse them, so the integration skips them (logged once)
    and saves again from the next step past the lost version.

    The same holds for committed steps after the one a load went back to: a framework whose roles
    are runs of their own (policy and critic) resumes from the newest step every role still has, so
    a role whose newer versions survived redoes steps it has committed; those versions stay listed
    (the timeline the resume left) and the redone steps are not saved again either.

    The call sequence: after a load of step N, ``used.resumed(engine, N)``; at each step the
    framework saves, ``if used.free(engine, step): push``. Every rank decides alone (each pushes
    alone); rank 0 logs the warnings, the others log them at debug level, so a job of N ranks
    says it once."""

    def __init__(self, run: str, logger: logging.Logger, rank: int = 0):
        self.run, self._log = run, logger
        self._level = logging.WARNING if rank == 0 else logging.DEBUG
        self._skipped_through = -1  # the used steps already logged as not saved again
        self._left: Optional[Tuple[int, int]] = None  # (step loaded, newest committed step after it)

    def resumed(self, engine: Any, step: int) -> None:
        """The version of ``step`` was loaded: committed steps after it are not saved again when redone."""
        newer = [s for s in engine.all_steps() if s > step]
        self._left = (step, max(newer)) if newer else None
        if newer:
            self._log.log(self._level, "ray_ckpt: run %r resumed from step %d and has committed steps after it "
                          "(%s): they stay listed, and their redo is not saved again (a step is never saved "
                          "twice); saving goes on after step %d", self.run, step, newer[-8:], max(newer))

    def free(self, engine: Any, step: int) -> bool:
        if self._left is not None and self._left[0] < step <= self._left[1]:
            return False  # logged by resumed()
        if step > engine.last_saved_step:
            return True  # the common case: one call to no one
        lost = lost_through(engine)
        if step > lost or step in engine.all_steps():
            return True  # never used, or a duplicate the coordinator names itself
        if self._skipped_through < lost:
            self._skipped_through = lost
            self._log.log(self._level, "ray_ckpt: run %r lost its versions up to step %d (with a node, or rolled "
                          "back; a step is never saved twice): the redone steps up to %d are not saved", self.run,
                          lost, lost)
        return False


def lost_through(engine: Any) -> int:
    """The newest step of a version the run no longer lists (lost with a node, rolled back), -1 if none."""
    return max(engine.skipped_versions(), default=-1)


def step_lost(engine: Any, step: int) -> bool:
    """Whether the version of ``step``, which committed once (a pointer names it), is gone: no longer
    listed (lost with a node, rolled back) and not in flight (a load of it could only fail)."""
    if step in engine.all_steps() or step not in engine.skipped_versions():
        return False
    return step not in {d.get("step") for d in engine.status().get("in_flight", {}).values()}


def newest_committed_pointer(folders: Iterable[str], run: str, committed: Iterable[int]) -> Optional[Tuple[str, int]]:
    """(folder, step) of the newest of ``folders`` whose pointer names a committed step of ``run``,
    or None: where a framework resumes when the version its marker names was lost."""
    steps = set(committed)
    best: Optional[Tuple[str, int]] = None
    for folder in folders:
        try:
            pointer = read_pointer(folder)
        except (OSError, ValueError):
            continue
        if pointer is None or pointer.get("run") != run:
            continue
        step = int(pointer.get("step", -1))
        if step in steps and (best is None or step > best[1]):
            best = (folder, step)
    return best


def drop_lost_pointer(folder: str, engine: Any, step: int) -> bool:
    """Remove ``folder``'s pointer when it names ``step`` and that version is lost (a redone step the
    integration does not save again): a framework marker advanced later must not find it, and a
    load of the folder then says the step never committed. Returns whether it was removed."""
    pointer = read_pointer(folder)
    if pointer is None or int(pointer.get("step", -1)) != step or not step_lost(engine, step):
        return False
    try:
        os.remove(os.path.join(folder, POINTER))
    except FileNotFoundError:
        return False
    return True
