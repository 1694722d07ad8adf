"""What OpenRLHF's resume reads, written when a version commits (never before it).

OpenRLHF saves into ``<save_dir>/<tag>`` (``tag`` is ``global_step<N>``) and resumes with
``load_ckpt(model, save_dir)``, where DeepSpeed reads the tag from ``<save_dir>/latest``. Rank 0
of :class:`RayCkptDeepspeedStrategy` writes, once the version commits:

* ``<save_dir>/<tag>/ray_ckpt.json``: the pointer (run, step, world size, ZeRO stage) that
  ``load_ckpt`` reads; a tag folder without one holds no committed ray_ckpt checkpoint;
* ``<save_dir>/latest`` (with ``save_latest``), atomically and only forward: a commit of an older
  step that finishes after a newer one never moves it back.

No OpenRLHF or DeepSpeed import here."""
from __future__ import annotations

import os
import re
from typing import Optional

from ..committed import LOCK, atomic_write, read_pointer

LATEST = "latest"  # deepspeed's engine.load_checkpoint reads the tag from <load_dir>/latest
_STEP_TAG = re.compile(r"^global_step(\d+)$")


def step_of_tag(tag: str) -> Optional[int]:
    m = _STEP_TAG.match(tag or "")
    return int(m.group(1)) if m else None


def read_latest(save_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(save_dir, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def advance_latest(save_dir: str, tag: str, step: int) -> str:
    """Write ``tag`` into ``<save_dir>/latest`` unless it names a newer committed step already."""
    with LOCK:
        current = read_latest(save_dir)
        if current is not None:
            pointer = read_pointer(os.path.join(save_dir, current))
            if pointer is not None and int(pointer.get("step", -1)) >= step:
                return current
        atomic_write(os.path.join(save_dir, LATEST), tag)
        return tag
