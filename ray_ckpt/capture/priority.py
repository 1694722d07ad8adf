"""CPU priority of ray_ckpt's background processes (the coordinator, the run's snapshot mailbox,
the writers) and threads (a learner's overlapped copy, the object-store prefault): below
training's, so that on a node whose cores training fills, checkpointing takes what training leaves.

Why every thread: on Linux the nice value belongs to a thread, and a thread inherits it only from
the thread that starts it. Ray starts its own threads (the core worker's RPC and event-loop
threads, which do most of a small actor's work: each call received, each reference borrowed)
before an actor's ``__init__`` runs, so ``os.nice`` in ``__init__`` would lower the Python task
thread alone. Measured with ``benchmarks/rllib_rate.py`` (RLlib PPO, a save every iteration, 2
cores): the coordinator and the mailbox at training's priority took the env runner's core in the
burst after each save.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger("ray_ckpt.priority")


def lower_thread_priority(nice: int, base: Optional[int] = None, tid: int = 0) -> bool:
    """Put thread ``tid`` (0: the calling one) ``nice`` below ``base`` (default: its own priority),
    capped at 19; threads it starts later inherit that. False where not supported or not permitted
    (the thread keeps its priority)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    try:
        own = os.getpriority(os.PRIO_PROCESS, tid)
        start = own if base is None else max(own, base)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, start + nice))
        return True
    except OSError as exc:  # a thread that ended meanwhile, or not permitted
        log.debug("ray_ckpt: thread %s keeps its priority (%s)", tid or "(caller)", exc)
        return False


def lower_process_priority(nice: int) -> int:
    """Put every thread of this process ``nice`` below the lower of its own priority and the
    calling thread's (capped at 19); threads started later inherit it from their starter. Returns
    how many threads were lowered (0 where not supported or not permitted: the process keeps its
    priority, which is only slower for training, never wrong).

    Why from the lower of the two: Ray runs a worker's task thread at nice 15
    (``RAY_worker_niceness``) and its core-worker threads at 0. Training in a Ray actor (an env
    runner sampling, a remote learner) runs at 15, so a background thread lowered from 0 to 5
    would still outrank it; lowered from 15 it does not."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread only
        tids = [0]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    return sum(lower_thread_priority(nice, base, tid) for tid in tids)
