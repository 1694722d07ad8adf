"""What SkyRL's resume reads, written when a step's versions commit (never before).

SkyRL's trainer saves each model into ``<ckpt_path>/global_step_N/<role>`` (``policy``, ``critic``)
and resumes from ``<ckpt_path>/latest_ckpt_global_step.txt`` (``RayPPOTrainer.load_checkpoints``).
Rank 0 of each role's :class:`RayCkptFSDPStrategy` writes, once its version of step N commits:

* ``global_step_N/<role>/ray_ckpt.json``: the pointer (run, step, world size) that
  ``load_checkpoint`` reads; a role folder without one holds no committed ray_ckpt version;
* the tracker, when step N is complete (:func:`complete`), atomically and only forward; folders
  that a resume past a lost version moved aside (``ray_ckpt_lost.global_step_M``, M <= N) are then
  deleted: the run has a complete step past them, and nothing in them can be loaded.

Step N is complete when every role listed in ``global_step_N/ray_ckpt_roles.json`` (written by
:class:`~ray_ckpt.integrations.skyrl.trainer.RayCkptTrainerMixin` before the trainer's saves, with
its own ``trainer_state.pt`` named there too) holds a pointer of step N and every file listed
exists; without that file (the strategy used on its own), when every role folder in
``global_step_N`` holds a pointer of step N. Whoever sees the last piece (a role's commit, or the
trainer once its files are written) advances the tracker. No SkyRL import here."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Iterable, List, Optional

from ..committed import LOCK, atomic_write, read_pointer, read_step_file

TRACKER = "latest_ckpt_global_step.txt"  # skyrl.train.trainer.RayPPOTrainer.save_checkpoints
ROLES = "ray_ckpt_roles.json"
LOST_PREFIX = "ray_ckpt_lost."  # a global_step_N folder moved aside: SkyRL lists only names starting global_step_
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LOST_DIR = re.compile(r"^" + re.escape(LOST_PREFIX) + r"(?:\d+\.)?global_step_(\d+)$")
log = logging.getLogger("ray_ckpt.skyrl")


def step_of_path(ckpt_dir: str) -> Optional[int]:
    """N of ``.../global_step_N/<role>``, else None."""
    m = _STEP_DIR.match(os.path.basename(os.path.dirname(os.path.abspath(ckpt_dir))))
    return int(m.group(1)) if m else None


def write_roles(step_dir: str, roles: list, files: list) -> None:
    """Before a step's saves: the roles (and the trainer's files) step N needs to be complete."""
    os.makedirs(step_dir, exist_ok=True)
    for role in roles:
        os.makedirs(os.path.join(step_dir, role), exist_ok=True)
    atomic_write(os.path.join(step_dir, ROLES), json.dumps({"roles": list(roles), "files": list(files)}))


def complete(step_dir: str, step: int) -> bool:
    """Whether every part of step ``step`` in ``step_dir`` is committed (see the module)."""
    try:
        with open(os.path.join(step_dir, ROLES)) as f:
            listed = json.load(f)
        roles, files = list(listed["roles"]), list(listed["files"])
    except FileNotFoundError:
        roles = [d for d in sorted(os.listdir(step_dir)) if os.path.isdir(os.path.join(step_dir, d))]
        files = []
    if not roles or not all(os.path.isfile(os.path.join(step_dir, f)) for f in files):
        return False
    for role in roles:
        pointer = read_pointer(os.path.join(step_dir, role))
        if pointer is None or int(pointer.get("step", -1)) != step:
            return False
    return True


def read_tracker(ckpt_path: str) -> Optional[int]:
    return read_step_file(os.path.join(ckpt_path, TRACKER))


def advance_if_complete(step_dir: str, step: int) -> Optional[int]:
    """Write ``step`` into the tracker above ``step_dir`` when the step is complete and the tracker
    names no newer step, then delete the folders moved aside up to it (:func:`drop_lost_folders`);
    returns the step the tracker names afterwards."""
    ckpt_path = os.path.dirname(os.path.abspath(step_dir))
    with LOCK:
        current = read_tracker(ckpt_path)
        if (current is not None and current >= step) or not complete(step_dir, step):
            return current
        atomic_write(os.path.join(ckpt_path, TRACKER), str(step))
    drop_lost_folders(ckpt_path, step)
    return step


def lost_folders(ckpt_path: str) -> List[str]:
    """Names of the ``ray_ckpt_lost.[n.]global_step_M`` folders in ``ckpt_path``: steps a resume past
    a lost version moved aside (:func:`~ray_ckpt.integrations.skyrl.trainer.resume_past_lost`)."""
    try:
        names = os.listdir(ckpt_path)
    except OSError:
        return []
    return sorted(n for n in names if _LOST_DIR.match(n))


def drop_lost_folders(ckpt_path: str, step: int) -> List[str]:
    """Delete the folders moved aside whose step is ``step`` or older, once ``step`` is complete: they
    name versions that were lost (or that the resume left behind) and SkyRL's own cleanup
    (``max_ckpts_to_keep``) never sees them. Returns the names deleted; a folder that cannot be
    removed is logged and left."""
    gone = []
    for name in lost_folders(ckpt_path):
        if int(_LOST_DIR.match(name).group(1)) > step:
            continue
        try:
            shutil.rmtree(os.path.join(ckpt_path, name))
            gone.append(name)
        except FileNotFoundError:
            pass  # another rank's commit removed it first
        except OSError as exc:
            log.warning("ray_ckpt: could not remove %s (moved aside by a resume past a lost version): %s",
                        os.path.join(ckpt_path, name), exc)
    if gone:
        log.info("ray_ckpt: step %d of %s is complete: removed %s, moved aside by a resume past a lost version",
                 step, ckpt_path, ", ".join(gone))
    return gone


def step_folders(ckpt_path: str) -> List[int]:
    """The steps N of the ``global_step_N`` folders in ``ckpt_path``, newest first."""
    try:
        names = os.listdir(ckpt_path)
    except OSError:
        return []
    return sorted((int(m.group(1)) for m in map(_STEP_DIR.match, names) if m), reverse=True)


def newest_complete_step(ckpt_path: str, below: int, committed: Iterable[int]) -> Optional[int]:
    """The newest step under ``below`` whose ``global_step_N`` is complete and whose version is among
    ``committed`` (the loading role's run): where SkyRL resumes when the version its tracker names
    was lost with its node."""
    have = set(committed)
    for step in step_folders(ckpt_path):
        if step < below and step in have and complete(os.path.join(ckpt_path, f"global_step_{step}"), step):
            return step
    return None


def rewind_tracker(ckpt_path: str, step: int) -> None:
    """Point SkyRL's tracker back at ``step`` (its newer step's version was lost)."""
    with LOCK:
        atomic_write(os.path.join(ckpt_path, TRACKER), str(step))
