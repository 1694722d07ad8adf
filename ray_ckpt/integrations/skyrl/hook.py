"""``install()``: make SkyRL's FSDP workers build :class:`RayCkptFSDPStrategy`.

SkyRL 0.4.0 has no registry of strategies: ``FSDPPolicyWorkerBase.init_model`` (and the critic's
and reference's) in ``skyrl/backends/skyrl_train/workers/fsdp/fsdp_worker.py`` call the name
``FSDPStrategy`` imported into that module. ``install()`` rebinds that one name to a selector that
builds ``RayCkptFSDPStrategy`` when ``$RAY_CKPT_SKYRL`` names a run and SkyRL's own
``FSDPStrategy`` otherwise, so it is safe in every worker process (Ray's ``runtime_env=
{"worker_process_setup_hook": "ray_ckpt.integrations.skyrl.install", "env_vars": {"RAY_CKPT_SKYRL":
...}}``). Nothing else of SkyRL is changed; ``uninstall()`` puts the name back. Checked against
skyrl 0.4.0: another release may move the call (tests/test_skyrl.py runs SkyRL's module itself)."""
from __future__ import annotations

from typing import Any

from .settings import read_settings

_MARK = "_ray_ckpt_selector"


def install() -> None:
    from . import cpu

    cpu.prepare()  # only on a machine without CUDA (see cpu.py); nothing on a GPU
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    current = fsdp_worker.FSDPStrategy
    if getattr(current, _MARK, False):
        return
    stock = current

    def FSDPStrategy(*args: Any, **kwargs: Any):  # noqa: N802 - replaces a class name
        if read_settings() is not None:
            from .strategy import RayCkptFSDPStrategy

            return RayCkptFSDPStrategy(*args, **kwargs)
        return stock(*args, **kwargs)

    setattr(FSDPStrategy, _MARK, True)
    FSDPStrategy.stock = stock
    fsdp_worker.FSDPStrategy = FSDPStrategy


def uninstall() -> None:
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    current = fsdp_worker.FSDPStrategy
    if getattr(current, _MARK, False):
        fsdp_worker.FSDPStrategy = current.stock


def installed() -> bool:
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    return bool(getattr(fsdp_worker.FSDPStrategy, _MARK, False))
