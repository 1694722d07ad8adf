"""What verl's own resume logic reads, written when a version commits (never before: verl#7952).

verl's trainer saves into ``<default_local_dir>/global_step_N/actor`` and reads back
``<default_local_dir>/latest_checkpointed_iteration.txt`` with
``verl.utils.checkpoint.checkpoint_manager.find_latest_ckpt_path``, which returns
``global_step_<tracker>`` if that folder exists. The manager's rank 0 writes, once the version of
step N commits:

* ``global_step_N/actor/ray_ckpt.json``: the pointer (run, step, world size, states) that
  ``load_checkpoint`` reads; a folder without one holds no committed ray_ckpt checkpoint;
* the tracker, atomically (a temporary file renamed over it) and only forward: a commit of an
  older step that finishes after a newer one never moves it back.

No verl import here."""
from __future__ import annotations

import os
import re
from typing import Any, List, Optional, Tuple

from ..committed import LOCK, atomic_write, newest_committed_pointer, read_pointer, read_step_file, step_lost

TRACKER = "latest_checkpointed_iteration.txt"  # verl.utils.checkpoint.checkpoint_manager.get_checkpoint_tracker_filename
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_of_path(local_path: str) -> Optional[int]:
    """N of ``.../global_step_N/<role>`` (or of ``.../global_step_N``), else None."""
    path = os.path.abspath(local_path)
    for part in (os.path.basename(os.path.dirname(path)), os.path.basename(path)):
        m = _STEP_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


def tracker_path(local_path: str, step: int) -> Optional[str]:
    """Where verl's trainer keeps the tracker for a save into ``local_path`` (the folder above
    ``global_step_<step>``), or None when ``local_path`` is not laid out as verl lays it out."""
    path = os.path.abspath(local_path)
    step_dir = os.path.dirname(path)
    if os.path.basename(step_dir) != f"global_step_{step}":
        return None
    return os.path.join(os.path.dirname(step_dir), TRACKER)


def advance_tracker(local_path: str, step: int) -> Optional[int]:
    """Write ``step`` into verl's tracker for ``local_path`` unless it already names a newer step.
    Returns the step the tracker names afterwards (None when ``local_path`` is not verl's layout)."""
    path = tracker_path(local_path, step)
    if path is None:
        return None
    with LOCK:
        current = read_step_file(path)
        if current is not None and current >= step:
            return current
        atomic_write(path, str(step))
        return step


def rewind_tracker(local_path: str, lost: int, step: int) -> Optional[str]:
    """Point verl's tracker for ``local_path`` (a save of step ``lost``, whose version was lost with
    its node) back at ``step``, the newest committed version: verl's next start resumes from it.
    Returns the tracker's path (None when ``local_path`` is not verl's layout)."""
    path = tracker_path(local_path, lost)
    if path is None:
        return None
    with LOCK:
        atomic_write(path, str(step))
    return path


def role_folders(local_path: str) -> List[str]:
    """``<root>/global_step_*/<role>`` for every step folder beside ``local_path``
    (``<root>/global_step_N/<role>``): where a committed version's pointer may be."""
    path = os.path.abspath(local_path)
    role, root = os.path.basename(path), os.path.dirname(os.path.dirname(path))
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, n, role) for n in names if _STEP_DIR.match(n)]


def read_tracker(checkpoint_dir: str) -> Optional[int]:
    """The step verl's tracker in ``checkpoint_dir`` (``trainer.default_local_dir``) names, or None."""
    return read_step_file(os.path.join(checkpoint_dir, TRACKER))


def fall_back(engine: Any, run: str, step: int, local_path: str) -> Optional[Tuple[Optional[int], str]]:
    """When ``local_path`` (``.../global_step_<step>/<role>``) holds the pointer of a version of
    ``run`` lost with its node, and it was the newest: move verl's tracker back to the newest
    committed step with a pointer folder beside it. Returns None when the version is not lost, else
    (the step the tracker names now, or None when none is left or the lost version was not the
    newest; a sentence saying what happened)."""
    if read_pointer(local_path) is None or not step_lost(engine, step):
        return None
    lost = (f"step {step} of ray_ckpt run {run!r} ({local_path}) was used by a version that is gone (lost with a node, "
            f"or rolled back)")
    found = newest_committed_pointer(role_folders(local_path), run, engine.all_steps())
    if found is not None and found[1] > step:  # not the newest: nothing to move the tracker back to
        return None, f"{lost}; newer steps are: {engine.all_steps()[-8:]}"
    if found is None:
        return None, (f"{lost} and no committed version of the run has a global_step folder beside it; committed "
                      f"steps: {engine.all_steps()[-8:] or 'none'}")
    tracker = rewind_tracker(local_path, step, found[1])
    return found[1], f"{lost}; the newest committed version is step {found[1]}" + (
        f": verl's tracker ({tracker}) now names it" if tracker else f": load {found[0]}")
