"""OpenRLHF integration: ``RayCkptDeepspeedStrategy``, OpenRLHF's ``DeepspeedStrategy`` whose
``save_ckpt`` / ``load_ckpt`` go through ray_ckpt. See docs/openrlhf.md.

=================== ===============================================================================
module              holds
=================== ===============================================================================
``settings``        the ``--ray_ckpt.*`` flags and ``args.ray_ckpt`` (:func:`read_settings`); no import
                    of OpenRLHF or DeepSpeed
``tracker``         the pointer file and DeepSpeed's ``latest`` file, written when a version commits
``zero``            a rank's ZeRO-1/2/3 partition as boxes of each flattened parameter, and back
``partition``       the ``optim`` state a save pushes, flattened once per layout and reused
``strategy``        :class:`RayCkptDeepspeedStrategy`
=================== ===============================================================================

OpenRLHF and DeepSpeed are imported on first use of a name that needs them
(``pip install "ray-ckpt[openrlhf]"``; see docs/openrlhf.md for the install lines).
"""
from __future__ import annotations

from typing import Any

from .settings import OpenRLHFSettings, add_arguments, read_settings
from ..committed import POINTER, read_pointer
from ..lazy import lazy_attribute

__all__ = ["RayCkptDeepspeedStrategy", "add_arguments", "read_settings", "OpenRLHFSettings", "read_pointer",
           "POINTER"]

_LAZY = {"RayCkptDeepspeedStrategy": "strategy"}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, globals(), _LAZY, name, needs=("openrlhf", "deepspeed", "flash_attn", "peft"),
                          what="OpenRLHF and DeepSpeed")
