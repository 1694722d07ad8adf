"""The ``--ray_ckpt.*`` flags: what an OpenRLHF command line adds to save through ray_ckpt.

OpenRLHF's command lines declare dotted flags (``--ckpt.path``) and turn them into nested
namespaces (``openrlhf.utils.config.hierarchize``: ``args.ckpt.path``); :func:`add_arguments`
declares ``--ray_ckpt.run`` and friends the same way, and :func:`read_settings` reads them back
from ``args.ray_ckpt`` (a namespace, a dict, or flat ``args.ray_ckpt_run``-style attributes). No
OpenRLHF or DeepSpeed import here."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from ..settings_block import engine_create_options
from ...errors import InvalidArgumentError

# the CheckpointEngine.create() options a flag may name directly
_CREATE = ("local_dir", "remote_uri", "keep_last", "keep_every", "critical_writers", "best_effort_writers",
           "rank_timeout_s")
_OWN = ("run", "load_wait_s", "connect_timeout_s", "apply_max_num", "engine_options", "overlap")


@dataclass(frozen=True)
class OpenRLHFSettings:
    run: str  # the run prefix: a save_dir of role R saves into run "<run>-<R>" (actor, critic)
    create: Dict[str, Any] = field(default_factory=dict)  # CheckpointEngine.create(run, **create)
    load_wait_s: float = 600.0  # load_ckpt waits at most this long for a version still in flight
    connect_timeout_s: float = 120.0
    apply_max_num: bool = True  # save_ckpt's max_num becomes the run's keep_last (unless keep_last is set)
    # copy the ZeRO partition into the object store while the rank trains on (the inner optimizer's
    # step waits for the copy): save_ckpt then costs only flattening the partition into views
    overlap: bool = True

    @property
    def creates(self) -> bool:
        """Rank 0 creates (get-or-create) the run when a ``local_dir`` is given; without one every
        rank connects to a run created elsewhere (by the driver)."""
        return bool(self.create.get("local_dir"))

    def run_of(self, save_dir: str) -> str:
        """The run of one model's checkpoints: OpenRLHF saves the actor into ``<ckpt.path>/_actor``
        and the critic into ``<ckpt.path>/_critic`` with one strategy, each from its own ranks, so
        each gets its own run (its versions commit without waiting for the other)."""
        import os

        role = re.sub(r"[^A-Za-z0-9_.-]+", "", os.path.basename(os.path.normpath(save_dir))).strip("_.-")
        return f"{self.run}-{role or 'model'}"


def add_arguments(parser: Any) -> Any:
    """Declare the ``--ray_ckpt.*`` flags on an argparse parser (OpenRLHF's ``--ckpt.*`` style)."""
    parser.add_argument("--ray_ckpt.run", type=str, default=None,
                        help="ray_ckpt run prefix; set it to save DeepSpeed checkpoints through ray_ckpt")
    parser.add_argument("--ray_ckpt.local_dir", type=str, default=None,
                        help="the local tier (rank 0 creates the run there); omit to connect to a run the driver created")
    parser.add_argument("--ray_ckpt.remote_uri", type=str, default=None, help="the remote tier (pyarrow.fs URI)")
    parser.add_argument("--ray_ckpt.keep_last", type=int, default=None,
                        help="versions kept (default: --ckpt.max_num, applied after each commit)")
    parser.add_argument("--ray_ckpt.rank_timeout_s", type=float, default=None)
    parser.add_argument("--ray_ckpt.load_wait_s", type=float, default=600.0)
    parser.add_argument("--ray_ckpt.overlap", type=_flag, default=None, metavar="{true,false}",
                        help="copy the ZeRO partition while training goes on (default true); false: save_ckpt "
                             "returns after the copy")
    return parser


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _flag(text: str) -> bool:
    """A true/false command-line value (argparse reports the ValueError as a usage error)."""
    value = _BOOLS.get(str(text).lower())
    if value is None:
        raise ValueError(f"expected true or false, got {text!r}")
    return value


def _as_dict(block: Any) -> Dict[str, Any]:
    if block is None:
        return {}
    if isinstance(block, Mapping):
        return dict(block)
    return {k: v for k, v in vars(block).items() if not k.startswith("_")}


def read_settings(args: Any) -> Optional[OpenRLHFSettings]:
    """The settings of ``args`` (``None`` when no ``ray_ckpt.run`` is set): ``args.ray_ckpt`` (what
    ``hierarchize`` makes of ``--ray_ckpt.*``), else flat ``args.ray_ckpt_<name>`` attributes."""
    if args is None:
        return None
    block = _as_dict(getattr(args, "ray_ckpt", None))
    if not block:
        block = {k[len("ray_ckpt_"):]: v for k, v in _as_dict(args).items() if k.startswith("ray_ckpt_")}
    block = {k: v for k, v in block.items() if v is not None}
    if not block.get("run"):
        return None
    create = engine_create_options(block, _CREATE, _OWN, "args.ray_ckpt")
    kw = {k: block[k] for k in ("load_wait_s", "connect_timeout_s", "apply_max_num", "overlap") if k in block}
    if "overlap" in kw:
        value = kw["overlap"]
        kw["overlap"] = _BOOLS.get(value.lower()) if isinstance(value, str) else value
        if not isinstance(kw["overlap"], bool):
            raise InvalidArgumentError(f"args.ray_ckpt.overlap must be true or false, got {value!r}")
    return OpenRLHFSettings(run=str(block["run"]), create=create, **kw)
