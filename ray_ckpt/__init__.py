"""ray_ckpt: non-blocking, tiered, verified checkpoints for reinforcement learning on Ray.

``CheckpointEngine``, ``SaveHandle`` and ``actor_provider`` are imported on first use (they bring
in Ray and torch), so ``ray-ckpt`` and other tools that only read checkpoints start quickly.
"""
from typing import Any

from .errors import (CheckpointError, IntegrityError, InvalidArgumentError, OwnershipError, RestoreError, SaveError,
                     SaveTimeoutError, UnsupportedTypeError)
from .types import (CheckpointMeta, Durability, OnBusy, OnPreemption, PreemptionNotice, RestoreReport, SaveResult,
                    StateReport, StateStatus, Strategy, TierName)

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "SaveHandle", "Strategy", "OnBusy", "Durability", "StateStatus", "TierName", "OnPreemption", "PreemptionNotice", "SaveResult", "RestoreReport", "StateReport",
    "CheckpointMeta", "CheckpointError", "SaveError", "SaveTimeoutError", "RestoreError", "IntegrityError",
    "InvalidArgumentError", "UnsupportedTypeError", "OwnershipError", "actor_provider", "actor_method", "rng_state", "set_rng_state",
    "fence", "state_from_snapshot",
]

_LAZY = {"CheckpointEngine": "client.engine", "SaveHandle": "client.handle", "actor_provider": "capture.snapshot",
         "actor_method": "capture.snapshot", "rng_state": "capture.rng", "set_rng_state": "capture.rng",
         "fence": "capture.overlap", "state_from_snapshot": "capture.snapshot"}


def __getattr__(name: str) -> Any:
    if name == "dcp":  # torch.distributed.checkpoint interop (rc.dcp.reader / rc.dcp.writer): imports torch
        import importlib

        module = importlib.import_module(".integrations.dcp", __name__)
        globals()["dcp"] = module
        return module
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_ckpt' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"dcp"})
