"""``install()``: make verl's FSDP engine build ``RayCkptCheckpointManager``.

verl 0.9.1 has no registry of checkpoint managers: ``FSDPEngine.initialize()``
(``verl/workers/engine/fsdp/transformer_impl.py``) calls the name ``FSDPCheckpointManager``
imported into that module. ``install()`` rebinds that one name to a selector that builds
``RayCkptCheckpointManager`` when the ``checkpoint_config`` it is given has a ``ray_ckpt`` block
naming a run, and verl's own ``FSDPCheckpointManager`` otherwise, so it is safe to install in every
worker process (e.g. Ray's ``runtime_env={"worker_process_setup_hook":
"ray_ckpt.integrations.verl.install"}``). Nothing else of verl is changed; ``uninstall()`` puts the
name back. Checked against verl 0.9.1: another release may move the call (the test suite runs
verl's module itself)."""
from __future__ import annotations

from typing import Any

from .settings import read_settings

_MARK = "_ray_ckpt_selector"


def install() -> None:
    from verl.workers.engine.fsdp import transformer_impl

    current = transformer_impl.FSDPCheckpointManager
    if getattr(current, _MARK, False):
        return
    stock = current

    def FSDPCheckpointManager(*args: Any, **kwargs: Any):  # noqa: N802 - replaces a class name
        config = kwargs.get("checkpoint_config", args[4] if len(args) > 4 else None)
        if read_settings(config) is not None:
            from .manager import RayCkptCheckpointManager

            return RayCkptCheckpointManager(*args, **kwargs)
        return stock(*args, **kwargs)

    setattr(FSDPCheckpointManager, _MARK, True)
    FSDPCheckpointManager.stock = stock
    transformer_impl.FSDPCheckpointManager = FSDPCheckpointManager


def uninstall() -> None:
    from verl.workers.engine.fsdp import transformer_impl

    current = transformer_impl.FSDPCheckpointManager
    if getattr(current, _MARK, False):
        transformer_impl.FSDPCheckpointManager = current.stock


def installed() -> bool:
    from verl.workers.engine.fsdp import transformer_impl

    return bool(getattr(transformer_impl.FSDPCheckpointManager, _MARK, False))
