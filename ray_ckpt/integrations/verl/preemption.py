"""Preemption notices into verl's own "save before the instance expires" check.

verl's ``RayPPOTrainer.fit`` saves a checkpoint at any step where
``verl.utils.checkpoint.checkpoint_manager.should_save_ckpt_esi`` says the instance is close to
expiring (within a save's and a step's duration, plus ``trainer.esi_redundant_time``), whatever
``save_freq`` says. It reads the expiry from the environment of the trainer's process
(``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP``, unix seconds). :func:`forward_preemption_notices`
sets that variable from the run's preemption notices (``engine.preemption()``: Ray drains a node
of the run with a deadline) on a daemon thread in the driver, and clears it when the notice ends,
so verl saves at its next step through ``RayCkptCheckpointManager`` while the coordinator copies the
drained node's versions away. No verl import: it only sets a variable verl reads.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

log = logging.getLogger("ray_ckpt")

ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"  # what verl's should_save_ckpt_esi reads
NO_DEADLINE_S = 30.0  # a drain without a deadline: reported as expiring this far ahead, renewed each poll


class PreemptionForwarder:
    """The thread :func:`forward_preemption_notices` starts; ``stop()`` ends it (and clears the
    variable if it set it)."""

    def __init__(self, engine: Any, poll_s: float):
        self.engine, self.poll_s = engine, poll_s
        self.notices = 0  # notices forwarded so far
        self.error: Optional[str] = None  # the last failure to ask the coordinator (retried)
        self._set = False
        self._previous = os.environ.get(ESI_ENV)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray_ckpt-verl-preemption", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            if not ray.is_initialized():  # the driver shut Ray down: never start or join another one here
                break
            try:
                self.forward(self.engine.preemption(max_age=0))
                self.error = None
            except Exception as exc:  # the coordinator is restarting: asked again next poll
                if self.error is None:
                    log.warning("ray_ckpt: reading the preemption notice failed: %s", exc)
                self.error = str(exc)
            self._stop.wait(self.poll_s)

    def forward(self, notice: Any) -> None:
        if notice is not None:
            deadline = notice.deadline if notice.deadline != float("inf") else time.time() + NO_DEADLINE_S
            if not self._set:
                self.notices += 1
                log.warning("ray_ckpt: preemption notice (%.0fs left): verl saves at its next step", deadline - time.time())
            os.environ[ESI_ENV] = str(deadline)
            self._set = True
        elif self._set:
            self._clear()

    def _clear(self) -> None:
        if self._previous is None:
            os.environ.pop(ESI_ENV, None)
        else:
            os.environ[ESI_ENV] = self._previous
        self._set = False

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._set:
            self._clear()


def forward_preemption_notices(run: Any, poll_s: float = 1.0) -> PreemptionForwarder:
    """In verl's driver (the process that runs ``RayPPOTrainer.fit``), once the run exists: forward
    the run's preemption notices (``run``: its name or a ``CheckpointEngine``) to verl's expiry check,
    so that verl saves at its next step whatever ``save_freq`` says. verl saves at every step while
    the notice lasts (its check is a window, not an event); each save is a push that returns at once."""
    if isinstance(run, str):
        import ray_ckpt as rc

        run = rc.CheckpointEngine.connect(run)
    return PreemptionForwarder(run, poll_s)


def rewind_lost_tracker(run: Any, checkpoint_dir: str, role: str = "actor") -> Optional[int]:
    """In verl's driver, after ``init_workers()`` (the run exists) and before ``fit()``: when verl's
    tracker in ``checkpoint_dir`` (``trainer.default_local_dir``) names a step whose version of
    ``run`` (its name or a ``CheckpointEngine``) was lost with its node, move it back to the newest
    committed step, so that ``fit()`` resumes from there in this start (without the call, the
    workers' load of the lost step moves it back and fails, and the next start resumes). Returns
    the step the tracker names afterwards (None: no tracker); a ``RestoreError`` when no committed
    step is left to resume from."""
    from ...errors import RestoreError
    from .tracker import fall_back, read_tracker

    step = read_tracker(checkpoint_dir)
    if step is None:
        return None
    if isinstance(run, str):
        import ray_ckpt as rc

        run = rc.CheckpointEngine.connect(run)
    back = fall_back(run, run.run, step, os.path.join(checkpoint_dir, f"global_step_{step}", role))
    if back is None:
        return step
    if back[0] is None:
        raise RestoreError(back[1])
    log.warning("ray_ckpt: %s: resuming from it", back[1])
    return back[0]


def resume_folder(checkpoint_dir: str, folder: str) -> str:
    """What verl's ``find_latest_ckpt_path`` returns once :func:`install` wrapped it: ``folder`` (the
    tracker's ``global_step_N``), or, when a ray_ckpt version that one of its role folders' pointers
    names (``actor``, ``critic``) was lost with its node, the folder of the newest step whose roles
    are all committed, the tracker moved back to it (:func:`rewind_lost_tracker`, role after role
    until none moves it). Why there: verl's trainer takes its step count and data position from that
    folder before the workers load, so this is the one place a resume can go back in the same
    start. A folder without a pointer (not a ray_ckpt save) is returned as it is; so is one whose
    run cannot be reached or has nothing older committed: the workers' load then says why."""
    import ray_ckpt as rc

    from ...errors import CheckpointError
    from ..committed import read_pointer
    from .tracker import read_tracker

    runs, engines = {}, {}
    for role in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            pointer = read_pointer(os.path.join(folder, role))
        except (OSError, ValueError):
            continue
        if pointer and pointer.get("run"):
            runs[role] = pointer["run"]
    step = first = read_tracker(checkpoint_dir)
    moved = bool(runs)
    while moved and step is not None:
        moved = False
        for role, run in runs.items():
            try:
                if role not in engines:  # connected once, checked at each step the tracker moves to
                    engines[role] = rc.CheckpointEngine.connect(run)
                back = rewind_lost_tracker(engines[role], checkpoint_dir, role)
            except CheckpointError as exc:
                log.warning("ray_ckpt: verl resumes from the step its tracker names (%s): %s", step, exc)
                break
            if back is not None and back != step:
                step, moved = back, True  # the roles are checked again at that step
                break
    return folder if step in (None, first) else os.path.join(os.path.dirname(folder), f"global_step_{step}")
