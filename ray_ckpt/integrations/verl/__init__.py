"""verl integration: ``RayCkptCheckpointManager``, a drop-in for verl's ``FSDPCheckpointManager``
(FSDP2) that saves through ray_ckpt. See docs/verl.md.

=================== ===============================================================================
module              holds
=================== ===============================================================================
``settings``        the ``checkpoint_config.ray_ckpt`` block (:func:`read_settings`); no verl import
``tracker``         the pointer file and verl's ``latest_checkpointed_iteration.txt``, written at commit
``manager``         :class:`RayCkptCheckpointManager` (save, background commit watch, load)
``hf_export``       the ``hf_model`` export, a Ray task on rank 0's node after the commit
``config``          :class:`RayCkptCheckpointConfig`, verl's ``CheckpointConfig`` + ``ray_ckpt``
``hook``            :func:`install` / :func:`uninstall`: verl's FSDP engine builds our manager, and
                    verl's resume goes back past a version lost with its node
``preemption``      :func:`forward_preemption_notices`: the run's notices into verl's expiry check;
                    :func:`rewind_lost_tracker`: a resume past a version lost with its node
=================== ===============================================================================

verl is imported on first use of a name that needs it (``pip install "ray-ckpt[verl]"``).
"""
from __future__ import annotations

from typing import Any

from .settings import VerlSettings, read_settings
from ..committed import POINTER, read_pointer
from ..lazy import lazy_attribute
from .preemption import forward_preemption_notices, rewind_lost_tracker
from .tracker import TRACKER

__all__ = ["RayCkptCheckpointManager", "RayCkptCheckpointConfig", "install", "uninstall", "installed",
           "read_settings", "VerlSettings", "read_pointer", "POINTER", "TRACKER", "forward_preemption_notices",
           "rewind_lost_tracker"]

_LAZY = {"RayCkptCheckpointManager": "manager", "RayCkptCheckpointConfig": "config", "install": "hook",
         "uninstall": "hook", "installed": "hook"}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, globals(), _LAZY, name, needs=("verl",), what="verl")
