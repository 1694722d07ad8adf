"""An engine's reading paths: ``load``, ``load_into`` and ``restore`` (with ``fallback``).

All three start from what the coordinator says is committed (one state's entry for a load, whole
manifests for a restore) and then read the files themselves, verified, from this process's tiers
(local first, then remote): the coordinator never moves a state's bytes. ``CheckpointEngine``
keeps the public methods (their signatures and docstrings) and hands the work to one
:class:`StateReader`, so the engine module shows the API and this one how reading is done.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from . import restore as stages
from ..storage import sharded_io
from ..storage.checkpoint_io import rank_files
from ..config import EngineConfig
from ..errors import IntegrityError, InvalidArgumentError, RestoreError, one_line
from ..formats.manifest import Manifest, StateEntry
from ..metrics import for_run as metrics_for_run
from ..capture.providers import Registration
from ..capture.restored import read_state_reported, tiers_of
from ..storage.layout import validate_name
from ..types import RestoreReport, StateReport, step_label

log = logging.getLogger("ray_ckpt")

# CheckpointEngine._call: (method(coordinator handle) -> ref, what, timeout, error) -> the answer
Call = Callable[..., Any]


def _naming(exc: RestoreError, skipped: Mapping[int, str]) -> RestoreError:
    """``exc``, naming the newer versions the restore passed over (if any) and why."""
    if not skipped:
        return exc
    return RestoreError(f"{exc}; newer versions skipped: " + "; ".join(f"{v}: {why}" for v, why in skipped.items()))


class StateReader:
    """Reads committed states for one engine; ``call`` asks its coordinator (reviving it if the
    engine owns the run), ``registry`` is the engine's own (a live view, not a copy)."""

    def __init__(self, run: str, config: EngineConfig, call: Call, registry: Mapping[str, Registration]):
        self.run, self.config, self._call, self._registry = run, config, call, registry

    # ------------------------------------------------------------------ what is committed
    def manifest(self, version: int = -1, step: Optional[int] = None) -> Manifest:
        m = self._call(lambda c: c.manifest.remote(version, step), "a manifest", error=RestoreError)
        if m is None:
            what = "" if version == -1 and step is None else (
                f" at step {step}" if step is not None else f" with version {version}")
            asked = step if step is not None else version
            why = self._call(lambda c: c.skipped_versions.remote(), "the skipped versions",
                             error=RestoreError).get(asked) if asked != -1 else None
            raise RestoreError(f"run {self.run!r} has no committed checkpoint{what}"
                               + (f" (it is not listed: {why})" if why else ""))
        return m

    def stored_state(self, name: str, step: int, allow_pickle: Optional[bool]) -> Tuple[str, StateEntry, bool]:
        """(the version's name in messages, the entry of ``name``, allow_pickle) for a load:
        RestoreError unless stored.
        Fetches that one state's entry, not the whole manifest (``coordinator.stored_state``)."""
        found = self._call(lambda c: c.stored_state.remote(name, -1, None if step == -1 else step),
                           "a manifest", error=RestoreError)
        if found is None:
            what = "" if step == -1 else f" at step {step}"
            raise RestoreError(f"run {self.run!r} has no committed checkpoint{what}")
        entry, of = found.entry, step_label(found.step, found.version)
        if entry is None:
            raise RestoreError(f"{of} of run {self.run!r} has no state {name!r} (it has: {', '.join(found.names)})")
        if entry.status != "stored":
            raise RestoreError(f"state {name!r} of {of} is {entry.status}: {entry.detail}")
        if allow_pickle is None:
            reg = self._registry.get(name)
            allow_pickle = bool(reg and reg.allow_pickle)
        return of, entry, allow_pickle

    # ------------------------------------------------------------------ one state into this process
    def load(self, name: Any, step: Any, rank: Optional[int], allow_pickle: Optional[bool],
             with_report: bool = False) -> Any:
        """``CheckpointEngine.load`` (its arguments already in the current form)."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"load: the state's name is required, e.g. engine.load('policy', step=-1); "
                                       f"got {name!r}")
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise InvalidArgumentError(f"load: step must be a step number or -1 (the latest), got {step!r}")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise InvalidArgumentError(f"load: rank must be a non-negative integer or None, got {rank!r}")
        of, entry, allow_pickle = self.stored_state(name, step, allow_pickle)
        if rank is None and entry.shards is not None:  # the full tensors of a sharded state
            try:
                state, reader = sharded_io.load_full(tiers_of(self.config), entry, name, bool(allow_pickle))
            except IntegrityError as exc:
                raise RestoreError(f"state {name!r} of {of}: {exc}") from None
            return (state, StateReport("restored", reader.tier, True, "", reader.bytes)) if with_report else state
        if rank is None:
            if len(entry.files) > 1 and not entry.replicated:
                raise InvalidArgumentError(
                    f"load({name!r}, rank=None): state {name!r} of {of} holds {len(entry.files)} "
                    f"rank-local parts of plain tensors (no DTensors), which cannot be assembled into full "
                    f"tensors; load one rank's part with rank=r")
            rank = 0
        files = rank_files(entry, name, rank)
        try:
            state, report = read_state_reported(tiers_of(self.config), files, name, allow_pickle)
        except (IntegrityError, OSError) as exc:
            raise RestoreError(f"state {name!r} of {of}: {one_line(exc)}") from None
        return (state, report) if with_report else state

    def load_into(self, name: str, state: Any, step: int, rank: int, strict: bool, world_size: Optional[int],
                  allow_pickle: Optional[bool]) -> StateReport:
        """``CheckpointEngine.load_into``."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"load_into: the state's name is required, got {name!r}")
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise InvalidArgumentError(f"load_into: step must be a step number or -1 (the latest), got {step!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidArgumentError(f"load_into: rank must be a non-negative integer, got {rank!r}")
        if world_size is None:
            dist = getattr(sys.modules.get("torch"), "distributed", None)
            if dist is not None and dist.is_available() and dist.is_initialized():
                world_size = dist.get_world_size()
        of, entry, allow_pickle = self.stored_state(name, step, allow_pickle)
        tiers = tiers_of(self.config)
        if entry.shards is not None:
            return sharded_io.load_into_state(tiers, entry, name, state, strict=strict, allow_pickle=allow_pickle)
        sharded_io.check_world_size(entry, name, of, world_size)
        return sharded_io.load_rank_local_into(tiers, entry, name, state, rank, strict=strict,
                                               allow_pickle=allow_pickle)

    # ------------------------------------------------------------------ registered providers
    def restore(self, step: int, strict: bool, names: Optional[Iterable[str]], rewind: bool,
                fallback: bool) -> RestoreReport:
        """``CheckpointEngine.restore``: plan, stage, verify and apply (``restore.py``), going
        back version by version with ``fallback``; rewinds the coordinator after, if asked. The
        engine moves its own step counters to the report's step."""
        t0 = time.perf_counter()
        wanted = list(self._registry) if names is None else list(names)
        for n in wanted:
            if n not in self._registry:
                raise InvalidArgumentError(f"state {n!r} is not registered")
        if fallback and step != -1:
            raise InvalidArgumentError("restore(fallback=True) goes back from the latest version; it takes "
                                       f"step=-1, not step={step}")
        candidates = self._call(lambda c: c.manifests.remote(), "the manifests", error=RestoreError) \
            if fallback else [self.manifest(-1) if step == -1 else self.manifest(step=step)]
        if not candidates:
            raise RestoreError(f"run {self.run!r} has no committed checkpoint")
        skipped: Dict[int, str] = {}
        i = 0
        while True:
            m = candidates[i]
            try:
                plan = stages.plan(m, self._registry, wanted)
                staged = stages.stage(plan, self.config)
                reports = stages.verify(staged, self._registry, strict, self.run)
            except stages.NoCopyVerified as exc:
                # a critical file of a listed version has no good copy on the tiers this process
                # reads: the coordinator checks every copy it can reach, and a version with none
                # left is no longer listed
                why = self._call(lambda c: c.recheck.remote(m.version), "a recheck", 600, RestoreError)
                if why is not None:
                    log.warning("restore: %s can no longer be restored and is no longer listed: %s",
                                step_label(m.step, m.version), why)
                if fallback and i < len(candidates) - 1:
                    skipped[m.version] = why or one_line(exc)
                    log.warning("restore(fallback=True): %s does not verify, trying an older one: %s",
                                step_label(m.step, m.version), one_line(exc))
                    i += 1
                    continue
                if step == -1 and not fallback and why is not None:  # the newest version listed now, then
                    skipped[m.version] = why
                    try:
                        candidates = [self.manifest(-1)]
                    except RestoreError as none:
                        raise _naming(none, skipped) from None
                    continue
                if why is not None:
                    raise RestoreError(f"{_naming(exc, skipped)}; it is no longer listed: {why}") from None
                raise RestoreError(f"{_naming(exc, skipped)}; it stays listed: the coordinator found a copy that "
                                   f"verifies, or one it cannot check from its node" + (
                                       "" if fallback or step != -1 else ". restore(fallback=True) restores the "
                                       "newest older version that verifies here")) from None
            except RestoreError as exc:
                if not fallback or i == len(candidates) - 1:
                    raise _naming(exc, skipped) from None
                skipped[m.version] = one_line(exc)
                log.warning("restore(fallback=True): %s does not verify, trying an older one: %s",
                            step_label(m.step, m.version), one_line(exc))
                i += 1
                continue
            break
        stages.apply(staged, reports, self._registry, self.run)
        # newer versions found in storage but not trusted (unreadable, mis-signed, off the chain)
        untrusted = self._call(lambda c: c.skipped_versions.remote(), "the skipped versions", error=RestoreError)
        skipped.update({v: why for v, why in untrusted.items() if v > m.version and v not in skipped})
        rewound: List[int] = []
        if rewind:
            rewound = self._call(lambda c: c.rewind.remote(m.version), "rewind", 300, RestoreError)
        seconds = time.perf_counter() - t0
        metrics_for_run(self.run).restored(seconds)
        return RestoreReport(m.version, m.step, reports, seconds, tuple(rewound), skipped)
