"""SkyRL integration: ``RayCkptFSDPStrategy``, SkyRL's ``FSDPStrategy`` (FSDP2) whose
``save_checkpoint`` / ``load_checkpoint`` go through ray_ckpt. See docs/skyrl.md.

=================== ===============================================================================
module              holds
=================== ===============================================================================
``settings``        the ``ray_ckpt`` settings (``ray_ckpt=`` or ``$RAY_CKPT_SKYRL``); no SkyRL import
``tracker``         the pointer file and SkyRL's ``latest_ckpt_global_step.txt``, written at commit
``strategy``        :class:`RayCkptFSDPStrategy` (save, background commit watch, load on any world size)
``trainer``         :class:`RayCkptTrainerMixin`: the trainer's own tracker write left to the commit
``hook``            :func:`install` / :func:`uninstall`: SkyRL's FSDP workers build our strategy
``export``          :func:`export_hf`: a committed version as a Hugging Face safetensors folder
``cpu``             the stand-ins for SkyRL's CUDA calls on a machine without a GPU (tests, benchmark)
=================== ===============================================================================

SkyRL is imported on first use of a name that needs it (``pip install "ray-ckpt[skyrl]"`` on
Python >= 3.12; see docs/skyrl.md for the install lines).
"""
from __future__ import annotations

from typing import Any

from .settings import ENV, SkyRLSettings, read_settings
from .tracker import TRACKER
from .export import export_hf
from ..committed import POINTER, read_pointer
from ..lazy import lazy_attribute

__all__ = ["RayCkptFSDPStrategy", "RayCkptTrainerMixin", "install", "uninstall", "installed", "export_hf",
           "read_settings", "SkyRLSettings", "ENV", "TRACKER", "POINTER", "read_pointer"]

_LAZY = {"RayCkptFSDPStrategy": "strategy", "RayCkptTrainerMixin": "trainer", "install": "hook",
         "uninstall": "hook", "installed": "hook"}


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, globals(), _LAZY, name, needs=("skyrl", "flash_attn"), what="SkyRL")
