"""``install()``: make verl's FSDP engine build ``RayCkptCheckpointManager``, and verl's resume go
back past a ray_ckpt version lost with its node.

verl 0.9.1 has no registry of checkpoint managers: ``FSDPEngine.initialize()``
(``verl/workers/engine/fsdp/transformer_impl.py``) calls the name ``FSDPCheckpointManager``
imported into that module. ``install()`` rebinds that one name to a selector that builds
``RayCkptCheckpointManager`` when the ``checkpoint_config`` it is given has a ``ray_ckpt`` block
naming a run, and verl's own ``FSDPCheckpointManager`` otherwise, so it is safe to install in every
worker process (e.g. Ray's ``runtime_env={"worker_process_setup_hook":
"ray_ckpt.integrations.verl.install"}``).

It also wraps ``verl.utils.checkpoint.checkpoint_manager.find_latest_ckpt_path``, which verl's
trainers call in the driver to pick the folder they resume from (``RayPPOTrainer._load_checkpoint``),
and rebinds it in the verl modules that imported it already. The wrapper returns what verl's returns
unless a role folder's pointer there (actor, critic) names a ray_ckpt version that was lost with its
node; then it returns the folder of the newest step whose roles are all committed and moves the
tracker back (``preemption.resume_folder``). Without
the wrapper that resume fails once and succeeds at the next start. verl's trainer runs in a Ray
worker process (``TaskRunner``), where the setup hook above installs both.

Nothing else of verl is changed; ``uninstall()`` puts both names back. Checked against verl 0.9.1:
another release may move the calls (the test suite runs verl's modules themselves)."""
from __future__ import annotations

import sys
from typing import Any

from .settings import read_settings

_MARK = "_ray_ckpt_selector"
# verl 0.9.1's modules that import find_latest_ckpt_path by name (a module imported after install()
# takes the wrapped one from checkpoint_manager itself)
_IMPORTERS = ("verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.trainer_base",
              "verl.experimental.fully_async_policy.fully_async_trainer",
              "verl.experimental.fully_async_policy.fully_async_rollouter",
              "verl.utils.checkpoint.checkpoint_handler")


def install() -> None:
    from verl.utils.checkpoint import checkpoint_manager
    from verl.workers.engine.fsdp import transformer_impl

    current = transformer_impl.FSDPCheckpointManager
    if not getattr(current, _MARK, False):
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

    found = checkpoint_manager.find_latest_ckpt_path
    if not getattr(found, _MARK, False):
        stock_find = found

        def find_latest_ckpt_path(path: Any, directory_format: str = "global_step_{}"):
            folder = stock_find(path, directory_format)
            if folder is None or directory_format != "global_step_{}":
                return folder
            from .preemption import resume_folder

            return resume_folder(path, folder)

        setattr(find_latest_ckpt_path, _MARK, True)
        find_latest_ckpt_path.stock = stock_find
        _rebind(stock_find, find_latest_ckpt_path)


def _rebind(old: Any, new: Any) -> None:
    """``find_latest_ckpt_path`` is ``new`` in verl's checkpoint_manager and in every module of
    ``_IMPORTERS`` imported so far that holds ``old``."""
    from verl.utils.checkpoint import checkpoint_manager

    checkpoint_manager.find_latest_ckpt_path = new
    for name in _IMPORTERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "find_latest_ckpt_path", None) is old:
            module.find_latest_ckpt_path = new


def uninstall() -> None:
    from verl.utils.checkpoint import checkpoint_manager
    from verl.workers.engine.fsdp import transformer_impl

    current = transformer_impl.FSDPCheckpointManager
    if getattr(current, _MARK, False):
        transformer_impl.FSDPCheckpointManager = current.stock
    found = checkpoint_manager.find_latest_ckpt_path
    if getattr(found, _MARK, False):
        _rebind(found, found.stock)


def installed() -> bool:
    from verl.workers.engine.fsdp import transformer_impl

    return bool(getattr(transformer_impl.FSDPCheckpointManager, _MARK, False))
