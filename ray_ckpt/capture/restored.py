"""Bringing restored state back into a provider: read and verify a state's files from the tiers as
this process sees them, hold it in the provider's process until every state of the restore has
verified (so a failed restore changes nothing), then apply it -- or drop it.

The functions whose first argument is ``actor`` run inside the provider actor through Ray's
``__ray_call__``, like the snapshot functions of ``snapshot.py``.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..errors import IntegrityError, RestoreError, one_line
from ..formats.manifest import FileEntry
from ..protocol import StagedState
from ..types import StateReport
from ..storage.checkpoint_io import NoGoodCopy, decode_files, read_files
from ..storage.tier import Tier
from .object_store import start_prefault
from .peer_reads import PeerCopies
from .snapshot import actor_set

_STAGED = "_ray_ckpt_staged"  # the actor attribute holding its staged states, by name


def hold(actor: Any, name: str, state: Any) -> None:
    """Keep a verified state in the provider's process until ``apply_in_actor`` or ``discard_in_actor``."""
    actor.__dict__.setdefault(_STAGED, {})[name] = state


def read_state(tiers: Sequence[Tier], files: List[FileEntry], name: str, allow_pickle: bool = False):
    """Read, verify and decode one part. Returns (state, tier used, problems seen)."""
    bufs, tier, problems = read_files(tiers, files)
    return decode_files(files, bufs, name=name, allow_pickle=allow_pickle), tier, problems


def read_state_reported(tiers: Sequence[Tier], files: List[FileEntry], name: str, allow_pickle: bool = False):
    """:func:`read_state` as (state, the StateReport a restore gives it: tier, problems, bytes)."""
    state, tier, problems = read_state(tiers, files, name, allow_pickle)
    return state, StateReport("restored", tier, True, "; ".join(problems), sum(f.size for f in files))


def stage_in_actor(actor: Any, name: str, config: Any, files: List[FileEntry],
                   allow_pickle: bool) -> StagedState:
    """Runs in the provider actor: read + verify the state from its node's tiers and hold it until
    every state of the restore is verified (so a failed restore changes nothing)."""
    if config.prefault_object_store:
        start_prefault()  # a restarted provider restores first: its next saves find the store mapped
    try:
        state, tier, problems = read_state(tiers_of(config), files, name, allow_pickle)
    except NoGoodCopy as exc:
        return StagedState(False, None, one_line(exc), unreadable=True)
    except (IntegrityError, RestoreError, OSError) as exc:
        return StagedState(False, None, one_line(exc))
    hold(actor, name, state)
    return StagedState(True, tier, "; ".join(problems), sum(f.size for f in files))


def tiers_of(config: Any) -> List[Any]:
    """The tiers as seen from this process, nearest first: its node's local tier, the run's peer
    replicas (``peer_reads.PeerCopies``, ``EngineConfig.may_hold_replicas``), then the remote tier."""
    remote = config.remote_tier()
    peers = [PeerCopies(config.run)] if config.may_hold_replicas else []
    return [config.local_tier()] + peers + ([remote] if remote is not None else [])


class NothingStagedError(RestoreError):
    """The provider actor holds no staged state to apply: its process was restarted after staging."""


def apply_in_actor(actor: Any, setter: str, name: str, attribute: Optional[str] = None) -> None:
    staged = actor.__dict__.get(_STAGED, {})
    if name not in staged:
        raise NothingStagedError(f"state {name!r}: nothing staged in this process (restarted after staging)")
    actor_set(actor, setter, attribute, name, staged.pop(name))


def discard_in_actor(actor: Any, name: str) -> None:
    actor.__dict__.get(_STAGED, {}).pop(name, None)
