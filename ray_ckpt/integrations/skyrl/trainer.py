"""``RayCkptTrainerMixin``: SkyRL's trainer writing its tracker only when a step has committed.

``RayPPOTrainer.save_checkpoints`` (skyrl 0.4.0) calls each model's ``save_checkpoint``, writes
``data.pt`` and ``trainer_state.pt``, then ``latest_ckpt_global_step.txt`` at once: with a
strategy whose save returns before its version commits, that would name a step that may never
commit. Mixed in before the trainer class (``class Trainer(RayCkptTrainerMixin, RayPPOTrainer)``),
``save_checkpoints`` first lists what the step needs (``global_step_N/ray_ckpt_roles.json``: the
roles saved and ``trainer_state.pt``), runs SkyRL's own method with its one write of the tracker
withheld, and advances the tracker itself if every role has committed by then; otherwise the last
role's rank 0 does at its commit (``tracker.py``). Everything else of SkyRL's method is kept: its
``data.pt``, ``trainer_state.pt``, callbacks and cleanup of old folders.

``load_checkpoints`` (resume mode ``latest``) first checks the step the tracker names: when a role's
version of it was lost with its node (:func:`resume_past_lost`), the tracker goes back to the newest
step every role still has and the newer ``global_step_N`` folders are moved aside (SkyRL's own
consistency check refuses a tracker far behind its newest folder), so the job resumes in this start;
they are deleted once a step past them is complete (``tracker.drop_lost_folders``)."""
from __future__ import annotations

import contextlib
import io as _io
import logging
import os
import sys
from typing import Any, Dict, Optional

from ...errors import CheckpointError, RestoreError
from ..committed import read_pointer, step_lost
from .tracker import (LOST_PREFIX, TRACKER, advance_if_complete, newest_complete_step, read_tracker, rewind_tracker,
                      step_folders, write_roles)

log = logging.getLogger("ray_ckpt.skyrl")

TRAINER_FILES = ("trainer_state.pt",)  # what SkyRL's load_checkpoints needs in global_step_N beside the roles


class _TrackerWithheld:
    """SkyRL's ``io`` module as the trainer sees it, except that writing ``tracker`` goes nowhere."""

    def __init__(self, io: Any, tracker: str):
        self._io, self._tracker = io, os.path.abspath(tracker)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._io, name)

    def open_file(self, path: str, mode: str = "rb"):
        if "w" in mode and os.path.abspath(str(path)) == self._tracker:
            return contextlib.nullcontext(_io.StringIO() if "b" not in mode else _io.BytesIO())
        return self._io.open_file(path, mode)


class RayCkptTrainerMixin:
    """Mix in before SkyRL's ``RayPPOTrainer`` (or a subclass); see the module."""

    def save_checkpoints(self) -> str:
        ckpt_path = self.cfg.trainer.ckpt_path
        step = int(self.global_step)
        step_dir = os.path.join(ckpt_path, f"global_step_{step}")
        roles = ["policy"] + (["critic"] if getattr(self, "has_critic", False) else [])
        write_roles(step_dir, roles, list(TRAINER_FILES))
        owner = next(c for c in type(self).__mro__[1:] if "save_checkpoints" in vars(c) and c is not RayCkptTrainerMixin)
        module = sys.modules[owner.__module__]
        stock = module.io
        module.io = _TrackerWithheld(stock, os.path.join(ckpt_path, TRACKER))
        try:
            folder = super().save_checkpoints()
        finally:
            module.io = stock
        advance_if_complete(step_dir, step)
        return folder

    def load_checkpoints(self):
        if str(getattr(getattr(self, "resume_mode", None), "value", "")) == "latest":
            resume_past_lost(self.cfg.trainer.ckpt_path)
        return super().load_checkpoints()


def resume_past_lost(ckpt_path: str, connect_timeout_s: float = 10.0) -> Optional[int]:
    """In SkyRL's driver, before its resume reads the tracker in ``ckpt_path``: when a role's version
    of the step it names was lost with its node (unlisted by the role's run), point the tracker at
    the newest complete step every role's run still lists, and move every newer ``global_step_N``
    folder aside (renamed ``ray_ckpt_lost.global_step_N``; they hold no version that can be loaded;
    deleted when the tracker next advances past them).
    Returns the step the tracker names afterwards (None: no tracker). A run that cannot be reached
    is not checked (the workers' load then reports a lost step itself); no complete step left is a
    ``RestoreError``."""
    import ray_ckpt as rc

    step = read_tracker(ckpt_path)
    if step is None:
        return None
    step_dir = os.path.join(ckpt_path, f"global_step_{step}")
    engines: Dict[str, Any] = {}
    for role in sorted(os.listdir(step_dir)) if os.path.isdir(step_dir) else []:
        pointer = read_pointer(os.path.join(step_dir, role)) if os.path.isdir(os.path.join(step_dir, role)) else None
        if pointer is None:
            continue
        try:
            engines[role] = rc.CheckpointEngine.connect(str(pointer["run"]), timeout=connect_timeout_s)
        except CheckpointError as exc:
            log.info("ray_ckpt: run %r of %s not reachable (%s): step %d not checked", pointer["run"], role, exc, step)
            return step
    lost = [role for role, engine in engines.items() if step_lost(engine, step)]
    if not lost:
        return step
    listed = set.intersection(*(set(engine.all_steps()) for engine in engines.values()))
    back = newest_complete_step(ckpt_path, below=step, committed=listed)  # every role's run lists it
    if back is None:
        raise RestoreError(f"step {step} of {ckpt_path} (the tracker's) lost its {', '.join(lost)} version with a "
                           f"node, and no older step is complete with every role's version still listed")
    rewind_tracker(ckpt_path, back)
    moved = []
    for s in step_folders(ckpt_path):
        if s > back:
            src = os.path.join(ckpt_path, f"global_step_{s}")
            dst = os.path.join(ckpt_path, f"{LOST_PREFIX}global_step_{s}")
            n = 1
            while os.path.exists(dst):
                dst, n = os.path.join(ckpt_path, f"{LOST_PREFIX}{n}.global_step_{s}"), n + 1
            os.rename(src, dst)
            moved.append(s)
    log.warning("ray_ckpt: step %d of %s lost its %s version with a node: resuming from step %d (the newest "
                "complete step every role still has); global_step folders %s moved aside as %sglobal_step_N",
                step, ckpt_path, ", ".join(lost), back, sorted(moved), LOST_PREFIX)
    return back
