"""The ``ray_ckpt`` settings of a SkyRL run: what switches SkyRL's FSDP checkpoints to ray_ckpt.

SkyRL builds its ``FSDPStrategy`` inside each worker from its own config dataclasses, which have no
field for other settings. The settings therefore come either as the strategy's ``ray_ckpt=``
argument (a mapping) or, for the workers SkyRL starts itself, from the environment variable
``RAY_CKPT_SKYRL``: a JSON object, set for every Ray worker through the job's
``runtime_env={"env_vars": {...}}``. No SkyRL import here."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from ..settings_block import engine_create_options
from ...errors import InvalidArgumentError

ENV = "RAY_CKPT_SKYRL"

# the CheckpointEngine.create() options the block may name directly; anything else goes in engine_options
_CREATE = ("local_dir", "remote_uri", "remote_options", "keep_last", "keep_every", "critical_writers",
           "best_effort_writers", "rank_timeout_s")
_OWN = ("run", "load_wait_s", "connect_timeout_s", "tracker", "overlap", "engine_options")


@dataclass(frozen=True)
class SkyRLSettings:
    run: str  # the run prefix: a ckpt_dir ``.../global_step_N/<role>`` saves into run ``<run>-<role>``
    create: Dict[str, Any] = field(default_factory=dict)  # CheckpointEngine.create(run, **create)
    load_wait_s: float = 600.0  # load_checkpoint waits at most this long for a step still in flight
    connect_timeout_s: float = 120.0
    tracker: bool = True  # write latest_ckpt_global_step.txt when the step's versions commit
    # copy the model and optimizer into the object store while the rank trains on (fenced by the
    # optimizer's step): save_checkpoint then costs only flattening the state into views
    overlap: bool = True

    @property
    def creates(self) -> bool:
        """Rank 0 creates (get-or-create) the run when a ``local_dir`` is given; without one every
        rank connects to a run created elsewhere (by the driver)."""
        return bool(self.create.get("local_dir"))

    def run_of(self, role: str) -> str:
        """The run of one model's checkpoints (``policy``, ``critic``): each role's ranks save on
        their own, so each gets its own run, committing without waiting for the other."""
        clean = "".join(c for c in role if c.isalnum() or c in "_.-").strip("_.-")
        return f"{self.run}-{clean or 'model'}"


def read_settings(block: Optional[Mapping[str, Any]] = None) -> Optional[SkyRLSettings]:
    """The settings of ``block``, else of ``$RAY_CKPT_SKYRL``; None when neither names a ``run``.
    An unknown key, a value of the wrong kind or unreadable JSON is an InvalidArgumentError."""
    if block is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        try:
            block = json.loads(text)
        except ValueError as exc:
            raise InvalidArgumentError(f"${ENV} is not a JSON object: {exc}") from None
    if not isinstance(block, Mapping):
        raise InvalidArgumentError(f"the ray_ckpt settings of SkyRL must be a mapping, got {type(block).__name__}")
    block = {k: v for k, v in block.items() if v is not None}
    if not block.get("run"):
        return None
    create = engine_create_options(block, _CREATE, _OWN, "ray_ckpt (SkyRL)")
    kw = {k: block[k] for k in ("load_wait_s", "connect_timeout_s", "tracker", "overlap") if k in block}
    for name in ("tracker", "overlap"):
        if name in kw and not isinstance(kw[name], bool):
            raise InvalidArgumentError(f"ray_ckpt (SkyRL): {name} must be true or false, got {kw[name]!r}")
    return SkyRLSettings(run=str(block["run"]), create=create, **kw)
