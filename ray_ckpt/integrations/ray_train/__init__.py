"""Ray Train integration: :class:`Checkpointer`, ray_ckpt as the checkpoint layer of a
``TorchTrainer`` train loop. See docs/ray-train.md.

=================== ===============================================================================
module              holds
=================== ===============================================================================
``checkpointer``    :class:`Checkpointer` (register, report, restore), the pointer checkpoints
                    reported to Ray Train once a version has committed, and
                    :func:`retention_options` (a ``CheckpointConfig`` as the run's retention)
=================== ===============================================================================

Ray Train is imported on first use of a name that needs it (``pip install "ray[train]"``).
"""
from __future__ import annotations

from typing import Any

from ..lazy import lazy_attribute

__all__ = ["Checkpointer", "retention_options"]

_LAZY = {"Checkpointer": "checkpointer", "retention_options": "checkpointer"}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, globals(), _LAZY, name, needs=("ray.train", "torch"), what="Ray Train")
