"""Overlapped snapshots: the copy of a state into the object store runs on a background thread of the
process that owns the state, and *fences* hold back in-place changes until their tensors are copied.

Why: without overlap the learner is paused for one full copy of its state per save (the physical
floor of a synchronous snapshot). With ``overlap=True`` the snapshot call only flattens the state
into views of its memory (no bytes move), hands them to this module's :class:`OverlapCopier`, and
returns; the learner's next forward/backward runs while the copy proceeds. The only thing that may
not happen meanwhile is an in-place change of a tensor still being copied, so before one:

- an optimizer's ``step`` (it changes its parameters and its moments): a step pre-hook
  (``Optimizer.register_step_pre_hook``) on every optimizer found among the provider's objects;
- a forward of a module whose buffers change in forward (BatchNorm's running statistics): a
  forward pre-hook on those modules;
- anything else (a replay buffer appended in place, an EMA target updated by hand): an explicit
  ``rc.fence(name)`` call or ``with rc.fence(name): ...`` block.

A fence waits only for the copies whose source memory overlaps the tensors about to change (by
address range), so an optimizer step waits for the state that holds its parameters, not for an
unrelated buffer. The rule, documented in docs/saving.md (overlapped snapshots): *a registered
state may only change in place after a fence*. A learner that breaks it must never get a silently torn snapshot: with
``RAY_CKPT_OVERLAP_CHECK=1`` (or ``check=True``) every copied array is checksummed at capture, in
the copy and in its source after the copy, and a mismatch fails the version naming the state and
its tensors.

This module is plain Python, no Ray (the torch hooks that fence are ``fence_hooks.py``): ``put``
(how bytes reach the store) and ``deliver`` (where the result goes) are given by the caller, so it
is unit-testable on its own.
CUDA tensors are staged into reused pinned host buffers on a side stream (``snapshot.HostStaging``);
their fence makes the training stream wait for the copy's CUDA event, without blocking the host
(``benchmarks/gpu_check.py`` exercises that path where a GPU is available).
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..config import check_enabled  # the debug check's switch: EngineConfig.overlap_check's default
from .fence_hooks import HookSet
from .priority import lower_thread_priority

log = logging.getLogger("ray_ckpt.overlap")


NICE_ENV = "RAY_CKPT_OVERLAP_NICE"
# below the learner (nice 0), above the critical writers (EngineConfig.critical_nice, 5): the
# learner's next fence waits for this copy, not for the writer, so on a shared core the copy must
# win: below the writers, a copy beside a writing writer takes several times longer and the fences
# before opt.step wait for it (benchmarks/overlap.py)
DEFAULT_NICE = 3


def copy_nice() -> int:
    """How much lower than the learner's the copy thread's CPU priority is (``RAY_CKPT_OVERLAP_NICE``,
    default 3: below the learner, above the critical writers; 0 keeps the learner's)."""
    try:
        return max(0, min(19, int(os.environ.get(NICE_ENV, DEFAULT_NICE))))
    except ValueError:
        return DEFAULT_NICE


def _yield_cpu(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: per thread, inherited by the
    threads it starts).

    Why: ``ray.put`` copies a large buffer with 6 threads of its own (Ray's ``parallel_memcopy``),
    started by the calling thread. At the learner's priority, on a machine with few cores, those 6
    threads take the learner's core for the length of the copy (CFS shares a core by thread); the
    step then slows by what the copy costs, which is the pause overlap exists to remove. With a
    lower priority they use the cores the learner leaves idle, and the learner keeps its own."""
    if nice > 0 and not lower_thread_priority(nice):  # not permitted here: the copy keeps the learner's
        log.info("ray_ckpt: the overlapped copy thread keeps its priority")


def _ranges_of(flat: Any) -> List[Tuple[int, int]]:
    """Sorted, merged host address ranges [lo, hi) of a flat state's arrays (views of the state's
    memory): those ``flatten`` recorded, else read from the arrays."""
    arrays = flat.arrays
    recorded = getattr(flat, "spans", None)
    if recorded is not None and len(recorded) == len(arrays):
        spans = [s for s in recorded if s[1] > s[0]]
    else:
        spans = []
        for a in arrays:
            n = getattr(a, "nbytes", 0)
            if n:
                lo = a.__array_interface__["data"][0]
                spans.append((lo, lo + n))
    spans.sort()
    merged: List[Tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _digests(arrays: Iterable[Any]) -> List[int]:
    import xxhash

    return [xxhash.xxh3_64_intdigest(memoryview(a).cast("B")) if a.nbytes else 0 for a in arrays]


@dataclass
class CopyJob:
    """One state's snapshot on its way into the object store."""

    name: str
    key: str
    flat: Any  # formats.flat.Flat of views into the live state (or into staging buffers)
    ranges: List[Tuple[int, int]] = field(default_factory=list)  # host memory the copy reads
    cuda_events: List[Any] = field(default_factory=list)  # device->host copies still running
    before: Optional[List[int]] = None  # checksums at capture (debug check)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None  # what put() returned (an ObjectRef in Ray)
    error: Optional[str] = None
    dest: Any = None  # where deliver() sends the result (the run's mailbox, in Ray)
    started: float = field(default_factory=time.perf_counter)  # queued (the snapshot call)
    began: float = 0.0  # the copy thread took it
    copy_s: float = 0.0
    faults: int = 0  # minor page faults of this process during the copy (untouched store pages)

    def overlaps(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.ranges, (hi, hi)) - 1  # last range starting before hi
        return i >= 0 and self.ranges[i][1] > lo and self.ranges[i][0] < hi


class OverlapCopier:
    """Background copies of snapshots, and the fences that wait for them (one per process).

    ``put(flat) -> result`` copies a flat state into the store; ``readback(result) -> arrays``
    (debug check only) returns the copied arrays; ``deliver(job)`` is called once the job is done or
    failed (``job.error``). Jobs run one at a time, in order, on one daemon thread."""

    def __init__(self, put: Callable[[Any], Any], deliver: Callable[[CopyJob], None],
                 readback: Optional[Callable[[Any], List[Any]]] = None, nice: Optional[int] = None):
        self.put = put
        self.deliver = deliver
        self.readback = readback
        self._jobs: Dict[str, CopyJob] = {}  # state name -> its newest job (pending or done)
        self._queue: "queue.Queue[CopyJob]" = queue.Queue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.busy = 0  # pending jobs: the hooks' fast path reads it without a lock
        self.nice = copy_nice() if nice is None else nice
        self.fence_waits: List[float] = []  # seconds each fence that had to wait waited (last 1000)
        # (state, queued at, copy began at, copy seconds, page faults, bytes) of the last 1000 copies
        self.history: List[Tuple[str, float, float, float, int, int]] = []
        self.call_s: List[float] = []  # seconds each overlapped snapshot call took (last 1000)
        self._holds = 0  # open held() blocks: jobs started meanwhile are parked, not queued
        self._parked: List[CopyJob] = []

    def warm(self) -> None:
        """Start the copy thread now (at register) rather than at the first snapshot."""
        with self._lock:
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="ray_ckpt-overlap-copy", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- starting copies
    def start(self, name: str, key: str, flat: Any, *, check: Optional[bool] = None,
              cuda_events: Optional[List[Any]] = None, dest: Any = None) -> CopyJob:
        """Queue the copy of ``flat`` (state ``name``); returns at once. A previous copy of the same
        state is waited for first: its buffers may be reused (device staging) and a learner that
        saves faster than it copies is paced by its copies instead of queueing them unboundedly."""
        prev = self._jobs.get(name)
        if prev is not None and not prev.done.is_set():
            self._wait([prev], None)
        if check is None:
            check = check_enabled()
        job = CopyJob(name, key, flat, _ranges_of(flat), list(cuda_events or []), dest=dest)
        if check:
            for ev in job.cuda_events:
                ev.synchronize()  # the staged bytes are what the state was at the snapshot
            job.before = _digests(flat.arrays)
        with self._lock:
            self._jobs[name] = job
            self.busy += 1
            self._ensure_thread()
            if self._holds:
                self._parked.append(job)
                return job
        self._queue.put(job)
        return job

    @contextlib.contextmanager
    def held(self):
        """Copies started inside the block begin when it ends (the outermost one, if nested).

        Why: a rank that snapshots several states in a row (a model, then its optimizer) would
        otherwise flatten the second while the first one's copy, and Ray's copy threads under it,
        already take the cores; on a machine with few cores the snapshot calls then take several
        times their own CPU. A fence inside the block on a parked copy starts the parked copies
        first (it never waits for a copy that cannot begin)."""
        with self._lock:
            self._holds += 1
        try:
            yield self
        finally:
            with self._lock:
                self._holds -= 1
            if not self._holds:
                self._release()

    def _release(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, []
        for job in parked:
            self._queue.put(job)

    def _run(self) -> None:
        _yield_cpu(self.nice)
        while True:
            job = self._queue.get()
            try:
                self._copy(job)
            except BaseException as exc:  # never leave a fence waiting on a job that cannot finish
                job.error = job.error or f"the copy of state {job.name!r} failed: {type(exc).__name__}: {exc}"
            finally:
                with self._lock:
                    self.busy -= 1
                job.done.set()
            try:
                self.deliver(job)
            except Exception as exc:  # the writer waiting for it fails the version; say why here too
                log.error("state %r: the finished copy could not be announced to its writer: %s", job.name, exc)
            job.flat = None  # the views into the live state are not kept past the copy
            job.result = None  # the receiver holds the copy now

    def _copy(self, job: CopyJob) -> None:
        t0 = job.began = time.perf_counter()
        f0 = _minflt()
        for ev in job.cuda_events:
            ev.synchronize()  # device->host copies into the pinned staging buffers have landed
        job.result = self.put(job.flat)
        job.copy_s = time.perf_counter() - t0
        job.faults = _minflt() - f0
        self.history.append((job.name, job.started, job.began, job.copy_s, job.faults, job.flat.nbytes))
        del self.history[:-1000]
        if job.before is not None:
            job.error = self._verify(job)

    def _verify(self, job: CopyJob) -> Optional[str]:
        """Debug check: the copy and the source after the copy both match the capture."""
        names = [info["name"] for info in job.flat.leaf_info]
        after = _digests(job.flat.arrays)
        copied = _digests(self.readback(job.result)) if self.readback is not None else after
        bad = [names[i] for i, (b, a, c) in enumerate(zip(job.before, after, copied)) if not b == a == c]
        if not bad:
            return None
        shown = ", ".join(repr(n) for n in bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
        return (f"state {job.name!r} changed in place while its overlapped snapshot was being copied "
                f"({shown}): the snapshot would be torn, so this version fails. Change a registered state "
                f"only after a fence: rc.fence({job.name!r}) (an optimizer step and BatchNorm's forward fence "
                f"themselves)")

    # ---------------------------------------------------------------- fences
    def pending(self) -> List[CopyJob]:
        with self._lock:
            return [j for j in self._jobs.values() if not j.done.is_set()]

    def fence(self, name: Optional[str] = None, tensors: Optional[Iterable[Any]] = None,
              timeout: Optional[float] = None) -> float:
        """Wait until the copies that read ``tensors`` (or state ``name``'s copy; or, with neither,
        every copy) are done; returns the seconds waited. CUDA tensors only make their device's
        current stream wait for the copy (the host does not block)."""
        if not self.busy:
            return 0.0
        jobs = self.pending()
        if name is not None:
            jobs = [j for j in jobs if j.name == name]
        if tensors is not None and jobs:
            host, device = _tensor_spans(tensors)
            if device:
                _stream_waits(jobs)
            jobs = [j for j in jobs if any(j.overlaps(lo, hi) for lo, hi in host)]
        return self._wait(jobs, timeout)

    def _wait(self, jobs: List[CopyJob], timeout: Optional[float]) -> float:
        if not jobs:
            return 0.0
        if self._parked:  # a copy parked by held() must begin before anything waits for it
            self._release()
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        for j in jobs:
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            if not j.done.wait(left):
                raise TimeoutError(f"ray_ckpt: the overlapped copy of state {j.name!r} did not finish within "
                                   f"{timeout}s")
        waited = time.perf_counter() - t0
        self.fence_waits.append(waited)
        del self.fence_waits[:-1000]
        return waited


def _minflt() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _tensor_spans(tensors: Iterable[Any]) -> Tuple[List[Tuple[int, int]], bool]:
    host, device = [], False
    for t in tensors:
        if getattr(t, "is_cuda", False):
            device = True
            continue
        if callable(getattr(t, "to_local", None)):  # a DTensor (FSDP2): its data_ptr() is 0, its shard's is not
            t = t.to_local()
        try:
            lo = t.data_ptr() if hasattr(t, "data_ptr") else t.__array_interface__["data"][0]
            n = t.numel() * t.element_size() if hasattr(t, "element_size") else t.nbytes
        except Exception:
            continue
        if n:
            host.append((lo, lo + n))
    return host, device


def _stream_waits(jobs: List[CopyJob]) -> None:
    """CUDA fence: the current stream waits for the side stream's device->host copies (no host block)."""
    import torch

    for j in jobs:
        for ev in j.cuda_events:
            torch.cuda.current_stream(ev.device if hasattr(ev, "device") else None).wait_event(ev)


# -------------------------------------------------------------------- the process's copier
_COPIER: Optional[OverlapCopier] = None
_HOOKS = HookSet()
_COPIER_LOCK = threading.Lock()


def process_copier(factory: Optional[Callable[[], OverlapCopier]] = None) -> Optional[OverlapCopier]:
    """This process's copier, created by ``factory`` on first use (None if none yet and no factory)."""
    global _COPIER
    with _COPIER_LOCK:
        if _COPIER is None and factory is not None:
            _COPIER = factory()
        return _COPIER


def process_hooks() -> HookSet:
    return _HOOKS


class fence:
    """``rc.fence(name)``: wait until this process's overlapped copy of state ``name`` (every
    state's, without a name) is done, before changing it in place. Also a context manager
    (``with rc.fence("replay"): buffer.append(...)``: the wait happens on entry). Returns at once
    when nothing is being copied; ``timeout`` (seconds) raises TimeoutError."""

    def __init__(self, name: Optional[str] = None, *, timeout: Optional[float] = None):
        self.name = name
        copier = _COPIER
        self.waited = copier.fence(name, timeout=timeout) if copier is not None else 0.0

    def __enter__(self) -> "fence":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __repr__(self) -> str:
        return f"fence({self.name!r}, waited={self.waited:.6f}s)"
