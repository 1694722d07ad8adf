"""Mapping Ray's shared-memory object store into a process ahead of its first snapshots.

Why: a snapshot is one copy of the state into the object store, and the learner is paused for it.
Ray maps the store's file into every worker, but each page is only entered into a process's page
tables the first time that process touches it, and Ray's allocator keeps handing out parts of the
store this process has not touched yet until it has touched all of it. On a VM each such fault
costs microseconds, so a put into a fresh store takes several times a memcpy of the same bytes
(``benchmarks/snapshot_pause.py``).

``start_prefault()`` maps the whole store into this process once, on a background thread, with
``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14). The cost is the reason it is opt-in
(``EngineConfig.prefault_object_store``): every page of the store becomes resident in shared memory
(as ``RAY_preallocate_plasma_memory=1`` does), which is memory Ray reserved for the store but would
otherwise allocate only as objects need it.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .priority import lower_thread_priority

log = logging.getLogger("ray_ckpt.object_store")

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
_STEP = 64 << 20  # bytes per madvise call: short calls, so the thread yields the mapping lock often


@dataclass
class PrefaultStatus:
    """What the background thread did: ``done`` once it ended; ``error`` says why it stopped early."""

    regions: int = 0
    total_bytes: int = 0
    bytes_done: int = 0
    seconds: float = 0.0
    done: bool = False
    error: Optional[str] = None


_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_status = PrefaultStatus()


def store_regions(maps_path: str = "/proc/self/maps") -> List[Tuple[int, int]]:
    """The address ranges where this process maps Ray's object store: shared, writable mappings of
    a file whose name starts with ``plasma`` (Ray names the store's file so, wherever
    ``_plasma_directory`` puts it)."""
    regions = []
    try:
        with open(maps_path) as f:
            lines = f.readlines()
    except OSError:
        return regions
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1][:2] != "rw" or fields[1][3] != "s":
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if os.path.basename(path).startswith("plasma"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            regions.append((lo, hi))
    return regions


def populate(regions: List[Tuple[int, int]], status: PrefaultStatus) -> PrefaultStatus:
    """Enter every page of ``regions`` into this process's page tables, recording progress in
    ``status``; stops at the first refusal (and says why in ``status.error``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    t0 = time.perf_counter()
    try:
        for lo, hi in regions:
            for addr in range(lo, hi, _STEP):
                n = min(_STEP, hi - addr)
                if madvise(addr, n, MADV_POPULATE_WRITE) != 0:  # ctypes releases the GIL meanwhile
                    err = ctypes.get_errno()
                    why = ("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14 needed)"
                           if err == errno.EINVAL else os.strerror(err))
                    status.error = f"stopped after {status.bytes_done >> 20} MiB: {why}"
                    log.info("ray_ckpt: mapping the object store ahead of snapshots %s", status.error)
                    return status
                status.bytes_done += n
    finally:
        status.seconds = time.perf_counter() - t0
        status.done = True
    return status


def start_prefault() -> PrefaultStatus:
    """Start mapping this process's view of the object store, once per process; returns at once.

    Safe to call from any thread, any number of times (later calls return the status)."""
    global _thread
    with _lock:
        if _thread is None:
            regions = store_regions()
            _status.regions = len(regions)
            _status.total_bytes = sum(hi - lo for lo, hi in regions)
            if not regions:
                _status.done = True
                _status.error = "no object store mapping found in this process"
            _thread = threading.Thread(target=populate, args=(regions, _status), name="ray_ckpt-prefault", daemon=True)
            _thread.start()
    return _status


def prefault_status(wait_s: float = 0.0) -> PrefaultStatus:
    """This process's prefault status, after waiting up to ``wait_s`` for the thread to end."""
    thread = _thread
    if thread is not None and wait_s > 0:
        thread.join(wait_s)
    return _status


# ---------------------------------------------------------------------------- only the pages needed
# Ray's object store allocates from the low end of its mapping first, but it does not reuse a freed
# snapshot's space at once: the raylet frees objects in batches (about once a second), so while
# saves follow each other the next snapshot lands above the last ones, and a put that reaches
# pages this process never touched pays a fault for every page. The pages a process's saves touch are
# therefore the first few snapshots' bytes of the mapping: ``NEEDED_COPIES`` of them are mapped
# ahead of the first save, and a copy that still met untouched pages extends the mapped prefix by
# ``GROW_COPIES`` more (``grow_needed``), so the prefix follows the run's real working set instead
# of guessing it. Pages once mapped stay resident in the store either way (the store does not give
# them back), so mapping them ahead costs time on a background thread, not memory the run would not
# use. The whole-store prefault (``prefault_object_store``) stays opt-in.
PREFIX_MARGIN = 64 << 20  # room for the other objects of the store that sit below the snapshots
NEEDED_COPIES = 4  # snapshots in flight (max_in_flight=2) + the ones the raylet has not freed yet
GROW_COPIES = 2
PREFAULT_NICE = 10  # the mapping thread leaves the learner's core to the learner


@dataclass
class PrefixStatus:
    """This process's needed-pages prefault: ``target`` bytes wanted, ``done`` mapped so far."""

    target: int = 0
    done: int = 0
    seconds: float = 0.0
    error: Optional[str] = None
    running: bool = False


_prefix = PrefixStatus()
_prefix_lock = threading.Lock()


_needed: dict = {}  # state name -> its snapshot's bytes, in this process


def prefault_needed(nbytes: int, name: str, copies: int = NEEDED_COPIES) -> PrefixStatus:
    """Map the first ``copies`` snapshots' bytes of this process's states (+ a margin) of the object
    store into this process, in the background; ``nbytes`` is state ``name``'s size (calls for the
    same name replace, so calling it at every snapshot costs a dict lookup). Returns at once. Does
    nothing when the whole store is being mapped already (``start_prefault``)."""
    with _prefix_lock:
        if _thread is not None or _needed.get(name, -1) >= nbytes:
            return _prefix
        _needed[name] = nbytes
        # "__actor__": an actor's whole holding, measured at register; named states: their snapshots
        states = sum(v for k, v in _needed.items() if k != "__actor__")
        _prefix.target = max(_prefix.target, PREFIX_MARGIN + copies * max(states, _needed.get("__actor__", 0)))
        _start_prefix()
    return _prefix


def grow_needed(nbytes: int, copies: int = GROW_COPIES) -> PrefixStatus:
    """A snapshot of ``nbytes`` was copied into pages this process had never touched: map
    ``copies`` more snapshots' bytes beyond what is mapped, in the background (see above)."""
    with _prefix_lock:
        if _thread is not None:
            return _prefix
        _prefix.target = max(_prefix.target, _prefix.done) + copies * nbytes
        _start_prefix()
    return _prefix


def _start_prefix() -> None:
    if not _prefix.running and _prefix.done < _prefix.target and not _prefix.error:
        _prefix.running = True
        threading.Thread(target=_populate_prefix, name="ray_ckpt-prefault-needed", daemon=True).start()


def _populate_prefix() -> None:
    lower_thread_priority(PREFAULT_NICE)
    regions = sorted(store_regions(), key=lambda r: r[1] - r[0], reverse=True)[:1]
    t0 = time.perf_counter()
    try:
        while True:
            with _prefix_lock:
                if not regions or _prefix.done >= _prefix.target or _prefix.error:
                    if not regions:
                        _prefix.error = "no object store mapping found in this process"
                    _prefix.running = False
                    return
                lo, hi = regions[0]
                start = lo + _prefix.done
                end = min(hi, lo + _prefix.target)
            if start >= end:
                with _prefix_lock:
                    _prefix.running = False
                return
            status = PrefaultStatus()
            populate([(start, end)], status)
            with _prefix_lock:
                _prefix.done += status.bytes_done
                _prefix.error = status.error
    finally:
        _prefix.seconds += time.perf_counter() - t0


def prefix_status() -> PrefixStatus:
    return _prefix


def state_nbytes(state: Any) -> int:
    """Bytes of the tensors and arrays in a nested state (what its snapshot puts in the store),
    counted without touching or copying them."""
    total, stack = 0, [state]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "element_size") and hasattr(x, "numel"):
            total += x.numel() * x.element_size()
        elif hasattr(x, "nbytes") and isinstance(getattr(x, "nbytes"), int):
            total += x.nbytes
    return total


def prefault_in_actor(actor, wait_s: float = 0.0) -> dict:
    """Runs in a provider actor through ``__ray_call__``."""
    start_prefault()
    return prefault_status(wait_s).__dict__.copy()
