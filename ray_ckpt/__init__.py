"""ray_ckpt: non-blocking, tiered, verified checkpoints for reinforcement learning on Ray."""
from .engine import CheckpointEngine, SaveHandle
from .errors import (CheckpointError, IntegrityError, InvalidArgumentError, RestoreError, SaveError,
                     UnsupportedTypeError)
from .snapshot import actor_provider
from .types import CheckpointMeta, OnBusy, RestoreReport, SaveResult, StateReport, Strategy

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "SaveHandle", "Strategy", "OnBusy", "SaveResult", "RestoreReport", "StateReport",
    "CheckpointMeta", "CheckpointError", "SaveError", "RestoreError", "IntegrityError",
    "InvalidArgumentError", "UnsupportedTypeError", "actor_provider",
]
