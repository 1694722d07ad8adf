"""The ``checkpoint_config.ray_ckpt`` block: what a verl config adds to switch to ray_ckpt.

No verl import here: the block is read from whatever verl hands the manager (its
``CheckpointConfig`` dataclass, an OmegaConf ``DictConfig`` or a plain dict)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from ray_ckpt import InvalidArgumentError
from ..settings_block import engine_create_options

# the CheckpointEngine.create() options the block may name directly; anything else goes in engine_options
_CREATE = ("local_dir", "remote_uri", "remote_options", "keep_last", "keep_every", "critical_writers",
           "best_effort_writers")
_OWN = ("run", "load_wait_s", "tracker", "hf_export_cpus", "engine_options", "connect_timeout_s", "overlap")


@dataclass(frozen=True)
class VerlSettings:
    run: str
    create: Dict[str, Any] = field(default_factory=dict)  # CheckpointEngine.create(run, **create)
    load_wait_s: float = 600.0  # load_checkpoint waits at most this long for a step still in flight
    tracker: bool = True  # write verl's latest_checkpointed_iteration.txt when a version commits
    hf_export_cpus: float = 0.5  # the Ray task that writes the hf_model export
    connect_timeout_s: float = 120.0
    # copy the model and optimizer into the object store while the rank trains on (fenced by the
    # optimizer's step): save_checkpoint then costs only flattening the state into views
    overlap: bool = True

    @property
    def creates(self) -> bool:
        """Rank 0 creates (get-or-create) the run when the block names a ``local_dir``; without one
        every rank connects to a run somebody else created (the driver, or another worker group)."""
        return bool(self.create.get("local_dir"))


def _plain(value: Any) -> Any:
    """An OmegaConf container as plain dicts / lists (other values as they are)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl always brings omegaconf
        pass
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def read_settings(checkpoint_config: Any) -> Optional[VerlSettings]:
    """The block of ``checkpoint_config`` (``None`` when it has none, or no ``run``)."""
    if checkpoint_config is None:
        return None
    block = checkpoint_config.get("ray_ckpt", None) if hasattr(checkpoint_config, "get") else \
        getattr(checkpoint_config, "ray_ckpt", None)
    block = _plain(block)
    if not block:
        return None
    if not isinstance(block, dict):
        raise InvalidArgumentError(f"checkpoint_config.ray_ckpt must be a mapping, got {type(block).__name__}")
    if not block.get("run"):
        return None
    create = engine_create_options(block, _CREATE, _OWN, "checkpoint_config.ray_ckpt")
    kw = {k: block[k] for k in ("load_wait_s", "tracker", "hf_export_cpus", "connect_timeout_s", "overlap")
          if k in block}
    if "overlap" in kw and not isinstance(kw["overlap"], bool):
        raise InvalidArgumentError(f"checkpoint_config.ray_ckpt.overlap must be true or false, got {kw['overlap']!r}")
    return VerlSettings(run=str(block["run"]), create=create, **kw)
