"""``RayCkptTrainerMixin``: SkyRL's trainer writing its tracker only when a step has committed.

``RayPPOTrainer.save_checkpoints`` (skyrl 0.4.0) calls each model's ``save_checkpoint``, writes
``data.pt`` and ``trainer_state.pt``, then ``latest_ckpt_global_step.txt`` at once: with a
strategy whose save returns before its version commits, that would name a step that may never
commit. Mixed in before the trainer class (``class Trainer(RayCkptTrainerMixin, RayPPOTrainer)``),
``save_checkpoints`` first lists what the step needs (``global_step_N/ray_ckpt_roles.json``: the
roles saved and ``trainer_state.pt``), runs SkyRL's own method with its one write of the tracker
withheld, and advances the tracker itself if every role has committed by then; otherwise the last
role's rank 0 does at its commit (``tracker.py``). Everything else of SkyRL's method is kept: its
``data.pt``, ``trainer_state.pt``, callbacks and cleanup of old folders."""
from __future__ import annotations

import contextlib
import io as _io
import os
import sys
from typing import Any

from .tracker import TRACKER, advance_if_complete, write_roles

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
