"""``RayCkptCheckpointConfig``: verl's ``CheckpointConfig`` with a ``ray_ckpt`` block.

verl 0.9 turns ``actor_rollout_ref.actor.checkpoint`` into the dataclass its ``_target_`` names
(hydra), and ``verl.trainer.config.CheckpointConfig`` has no field for other settings: a config
that only adds a ``ray_ckpt:`` block fails there. Point ``_target_`` at this subclass (as verl's
own Megatron config does with ``McoreCheckpointConfig``)::

    checkpoint:
      _target_: ray_ckpt.integrations.verl.RayCkptCheckpointConfig
      ray_ckpt: {run: my-run, local_dir: /mnt/nvme/ckpt, remote_uri: s3://bucket/ckpt, keep_last: 3}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from verl.trainer.config import CheckpointConfig


@dataclass
class RayCkptCheckpointConfig(CheckpointConfig):
    ray_ckpt: Dict[str, Any] = field(default_factory=dict)
