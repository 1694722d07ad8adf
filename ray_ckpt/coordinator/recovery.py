"""What a (re)starting coordinator rebuilds from storage, before it accepts any call.

The coordinator keeps nothing that storage does not also hold, so its start is a recovery: scan
both tiers' manifests (what is committed, what is not trusted and why), clear what a predecessor
left half-done (version directories without a manifest, temporary files of a killed writer), and
read back the pushed-state declarations, the driver's states and which node holds each local file
(its manifest says). Kept apart from the actor so that the start-up rules read in one place and
run without Ray (``recover`` needs only the tiers).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

from .catalogue import Catalogue
from ..storage.checkpoint_io import delete_version, scan
from ..config import EngineConfig
from ..errors import CheckpointError, IntegrityError, one_line
from ..formats.manifest import Manifest, chain_suspects
from ..protocol import Declaration
from ..storage.durable_batch import remove_temporaries
from ..storage.head import missing_head, read_heads
from ..storage.lost import hide_lost, read_lost
from ..storage.tier import Tier
from .upload_plan import UploadPlan

log = logging.getLogger("ray_ckpt.coordinator")
DECLARED = "declared_states.json"  # pushed-state declarations, so a restarted coordinator knows them
DRIVER_STATES = "driver_states.json"  # the states the driver's save() brings (Catalogue.expect_driver)


@dataclass
class Recovered:
    """The coordinator's starting point: the local catalogue (declarations and driver states
    included), the upload plan (what the remote tier holds and what is still owed to it), and the
    versions found but not trusted (unreadable, mis-signed, or off the manifest chain) with why:
    listed by status() and by a restore that goes past them, never restored."""

    catalogue: Catalogue
    uploads: UploadPlan
    skipped: Dict[int, str]
    heads: Dict[str, int]  # each tier's head record (storage/head.py): the newest step committed there
    # local file path -> the node whose local tier holds it, as the local manifests record it
    # (replication.py judges a node's loss by it)
    file_nodes: Dict[str, str]


def recover(config: EngineConfig, local: Tier, remote: Optional[Tier]) -> Recovered:
    """Scan both tiers and clean what a previous coordinator left unfinished (see the module)."""
    key = config.signing_key
    committed, partial, bad = scan(local, key)
    for problem in bad:
        log.warning("ignoring %s", problem)
    skipped: Dict[int, str] = problems_by_version(bad)
    for v, why in chain_suspects(committed).items():
        log.error("version %d is not trusted: %s", v, why)
        skipped[v] = why
        committed.pop(v, None)
    lost = hide_lost(committed, read_lost(local))  # lost with a node: never listed again
    skipped.update(lost)
    catalogue = Catalogue(config.run, committed)
    catalogue.signing_key = key
    catalogue.reserved_through = max(lost, default=-1)
    remove_partial(local, partial, catalogue.kept_paths(set()))
    _remove_temporaries(local, catalogue)
    _load_declarations(local, catalogue)
    _load_driver_states(local, catalogue)
    remote_committed: Dict[int, Manifest] = {}
    remote_partial: List[int] = []
    if remote is not None:
        try:
            remote_committed, remote_partial, remote_bad = scan(remote, key)
            for v, why in problems_by_version(remote_bad).items():
                skipped.setdefault(v, f"remote tier: {why}")
            for v, why in chain_suspects(remote_committed).items():
                skipped.setdefault(v, f"remote tier: {why}")
                remote_committed.pop(v, None)
        except Exception as exc:  # remote down at (re)start: local checkpointing goes on
            log.warning("cannot list the remote tier %s: %s", remote.display, remote.scrub(one_line(exc)))
    uploads = UploadPlan(config.remote_every, remote is not None, remote_committed, catalogue.committed)
    catalogue.untrusted = skipped
    remove_partial(remote, remote_partial, uploads.paths)
    heads, problems = read_heads([t for t in (local, remote) if t is not None], config.run, key)
    for problem in problems:
        log.warning("ignoring %s", problem)
    gap = missing_head(heads, max(list(catalogue.committed) + list(remote_committed), default=None))
    if gap is not None:  # a rollback: the newest versions went away behind the engine's back
        step, why = gap
        log.error("run %r: version %d was %s", config.run, step, why)
        skipped.setdefault(step, why)
        catalogue.reserved_through = max(catalogue.reserved_through, step)
    return Recovered(catalogue, uploads, skipped, heads, recorded_nodes(catalogue.committed))


def recorded_nodes(committed: Dict[int, Manifest]) -> Dict[str, str]:
    """file path -> node, for every file of ``committed`` whose manifest names its node (a manifest
    written before nodes were recorded names none: its files count as the coordinator's node's)."""
    return {f.path: f.node for m in committed.values() for e in m.states.values() for f in e.all_files()
            if f.node is not None}


def problems_by_version(problems: List[str]) -> Dict[int, str]:
    """scan()'s problems ("version N: why") by version."""
    out: Dict[int, str] = {}
    for p in problems:
        head, _, why = p.partition(": ")
        if head.startswith("version ") and head[8:].isdigit():
            out[int(head[8:])] = why
    return out


def remove_partial(tier: Optional[Tier], partial: List[int], keep: Set[str]) -> None:
    """Version directories without a manifest at start-up are saves (local tier) or uploads
    (remote tier) that were in flight when the previous coordinator stopped (its writers stop
    with it): never listed, only taking space. Removed before this coordinator accepts a save
    that could write the same version again; files committed versions refer to (``keep``: a
    RELOADABLE state stored once) stay."""
    for v in partial:
        try:
            removed = delete_version(tier, v, keep, [])
        except Exception as exc:  # e.g. the remote tier down at a restart: they are only garbage
            log.warning("version %d: cannot remove its partial files on the %s tier: %s", v, tier.name,
                        one_line(exc))
            continue
        if removed:
            log.warning("version %d was not finished on the %s tier before the coordinator stopped; "
                        "removed its %d partial file(s)", v, tier.name, len(removed))


def _remove_temporaries(local: Tier, catalogue: Catalogue) -> None:
    """``*.tmp-*`` files a writer killed mid-batch left in committed versions (its restarted
    self redid the batch under other names; the previous coordinator stopped before sweeping
    them at the version's end): nothing writes into a committed version now."""
    for v in list(catalogue.committed):
        try:
            removed = remove_temporaries(local, v)
        except Exception as exc:  # only garbage: never a reason not to start
            log.warning("version %d: cannot remove temporary files: %s", v, one_line(exc))
            continue
        if removed:
            log.warning("version %d: removed %d temporary file(s) a killed writer left", v, len(removed))


def _load_declarations(local: Tier, catalogue: Catalogue) -> None:
    try:
        if not local.exists(DECLARED):
            return
        declared = json.loads(bytes(local.read_bytes(DECLARED)))
        if not isinstance(declared, dict):
            raise ValueError("not a JSON object")
    except (IntegrityError, ValueError, OSError) as exc:  # a link, a FIFO, garbage: not ours to follow
        log.error("ignoring %s: %s", DECLARED, one_line(exc))
        return
    for name, d in declared.items():
        try:
            decl = Declaration.from_json(name, d)
            catalogue.declare(name, decl.strategy, decl.world_size, decl.replicated, decl.allow_pickle)
        except (CheckpointError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the declaration of %r in %s: %s", name, DECLARED, one_line(exc))


def _load_driver_states(local: Tier, catalogue: Catalogue) -> None:
    try:
        if local.exists(DRIVER_STATES):
            catalogue.expect_driver(json.loads(bytes(local.read_bytes(DRIVER_STATES))))
    except (CheckpointError, IntegrityError, ValueError, OSError, TypeError) as exc:
        log.error("ignoring %s: %s", DRIVER_STATES, one_line(exc))
