"""Restore in named stages: plan -> stage -> verify -> apply (-> rewind, by the engine).

1. ``plan``   (no Ray, no I/O): which registered state comes from which files of the manifest, into
   which provider; what is missing, rebuilt by a loader or skipped. A rank-local state saved by N
   ranks and restored into M != N rank providers is refused here, before any actor is touched; a
   sharded (DTensor) state goes to any number of rank providers.
2. ``stage``  every state is read from its tiers and verified against the manifest's checksums
   where it will live: inside its provider actor (held there, not applied) or in this process. A
   sharded state is staged with ``load_into`` semantics: the provider's current state (its
   ``ckpt_get_state``: DTensors on its own mesh) is copied and the copy filled with this rank's
   shards, so the provider reshards and its live state is untouched until ``apply``.
3. ``verify`` the staged outcomes become the per-state reports; with ``strict`` a CRITICAL or
   RELOADABLE state that did not verify fails the whole restore and every staged state is dropped,
   so a failed restore changes nothing.
4. ``apply``  the verified states are handed to their providers (``ckpt_set_state``, a loader,
   ``load_state_dict``); a provider that refuses its state is named in a RestoreError.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import ray

from ..storage.checkpoint_io import NoGoodCopy, rank_files
from ..storage.tier import farther
from ..errors import IntegrityError, RestoreError, one_line
from ..formats.manifest import FileEntry, Manifest, StateEntry
from ..protocol import StagedState
from ..capture.providers import Registration
from ..capture.restored import (NothingStagedError, apply_in_actor, discard_in_actor, hold, read_state_reported,
                                stage_in_actor, tiers_of)
from ..capture.snapshot import ActorProvider, actor_get
from ..types import StateReport, Strategy, step_label

StageKey = Tuple[str, Optional[int]]  # (state, rank) — rank None: the state's single provider


class NoCopyVerified(RestoreError):
    """A strict restore failed, and at least one CRITICAL / RELOADABLE state failed because no tier
    this process reads held a copy of one of its files that verified: a question for the
    coordinator, which can check every copy (``coordinator/recheck.py``)."""


RESTARTING_WAIT_S = 120.0  # how long a restore waits for a provider actor that Ray is restarting


@dataclass
class ActorRead:
    name: str
    rank: Optional[int]
    provider: ActorProvider
    files: List[FileEntry]
    allow_pickle: bool
    sharded: Optional[StateEntry] = None  # a DTensor state: staged with load_into semantics


@dataclass
class LocalRead:
    name: str
    files: List[FileEntry]
    allow_pickle: bool


@dataclass
class RestorePlan:
    manifest: Manifest
    reports: Dict[str, StateReport] = field(default_factory=dict)  # decided without reading
    actor_reads: List[ActorRead] = field(default_factory=list)
    local_reads: List[LocalRead] = field(default_factory=list)
    reloads: List[str] = field(default_factory=list)  # RELOADABLE states rebuilt by loader()


@dataclass
class Staged:
    """What the stage step produced: refs to states held in actors, states read here."""

    plan: RestorePlan
    config: Any = None
    in_actors: Dict[StageKey, Any] = field(default_factory=dict)     # -> ObjectRef of a StagedState
    local: Dict[str, Any] = field(default_factory=dict)              # state read in this process
    reports: Dict[str, StateReport] = field(default_factory=dict)    # of the local reads
    unreadable: Set[str] = field(default_factory=set)  # states with a file no tier had a good copy of


def plan(manifest: Manifest, registry: Mapping[str, Registration], names: Sequence[str]) -> RestorePlan:
    """Stage 1: decide where every wanted state comes from. Raises RestoreError, touching nothing,
    when a rank-local state would be restored into a different number of ranks than saved it."""
    p = RestorePlan(manifest)
    m = manifest
    for name in names:
        reg = registry[name]
        entry = m.states.get(name)
        if entry is None:
            p.reports[name] = StateReport("missing", None, False,
                                          f"{step_label(m.step, m.version)} has no state {name!r}")
        elif entry.status == "loader":
            p.reports[name] = StateReport("reloaded", None, False, "rebuilt by its loader")
            p.reloads.append(name)
        elif entry.status != "stored":
            p.reports[name] = StateReport("missing", None, False, entry.detail or entry.status)
        elif reg.world_size is not None:
            _plan_ranks(p, reg, entry)
        elif isinstance(reg.provider, ActorProvider):
            p.actor_reads.append(ActorRead(name, None, reg.provider, rank_files(entry, name, 0), reg.allow_pickle))
        elif reg.provider.loader is None:
            p.reports[name] = StateReport("skipped", None, False, "no loader was registered for it")
        else:
            p.local_reads.append(LocalRead(name, rank_files(entry, name, 0), reg.allow_pickle))
    return p


def _plan_ranks(p: RestorePlan, reg: Registration, entry: Any) -> None:
    name, m = reg.name, p.manifest
    if not reg.rank_providers:
        how = f"engine.load_into({name!r}, state, step={m.step}, rank=r) (any world size)" \
            if entry.shards is not None else f"engine.load({name!r}, step={m.step}, rank=r)"
        p.reports[name] = StateReport("skipped", None, False, f"pushed state: each rank loads its part with {how}")
        return
    if entry.shards is not None:  # resharding-capable: any number of rank providers
        for r, prov in enumerate(reg.rank_providers):
            p.actor_reads.append(ActorRead(name, r, prov, [], reg.allow_pickle, sharded=entry))
        return
    saved = len(entry.files)
    if not entry.replicated and saved != len(reg.rank_providers):
        raise RestoreError(f"state {name!r} of {step_label(m.step, m.version)} was saved by {saved} ranks; it "
                           f"cannot be restored into {len(reg.rank_providers)} rank providers (world size {saved} != "
                           f"{len(reg.rank_providers)}): its parts are rank-local, not resharding-capable; "
                           f"nothing was loaded")
    for r, prov in enumerate(reg.rank_providers):
        p.actor_reads.append(ActorRead(name, r, prov, rank_files(entry, name, r), reg.allow_pickle))


def stage(p: RestorePlan, config: Any) -> Staged:
    """Stage 2: read and verify every planned state where it will be applied (not applied yet)."""
    s = Staged(p, config)
    for a in p.actor_reads:
        s.in_actors[(a.name, a.rank)] = _stage_call(a, config)
    for r in p.local_reads:
        try:
            s.local[r.name], s.reports[r.name] = read_state_reported(tiers_of(config), r.files, r.name, r.allow_pickle)
        except (IntegrityError, RestoreError, OSError) as exc:
            s.reports[r.name] = StateReport("missing", None, False, one_line(exc))
            if isinstance(exc, NoGoodCopy):
                s.unreadable.add(r.name)
    return s


def _stage_call(a: ActorRead, config: Any) -> Any:
    """Ask ``a``'s provider actor to read and hold its state (a ref to its StagedState)."""
    if a.sharded is not None:
        return a.provider.handle.__ray_call__.remote(stage_sharded_in_actor, a.name, config, a.sharded,
                                                     a.allow_pickle, a.provider.get, a.provider.attribute)
    return a.provider.handle.__ray_call__.remote(stage_in_actor, a.name, config, a.files, a.allow_pickle)


def _staged_result(s: Staged, a: ActorRead) -> StagedState:
    """The StagedState of ``a``'s stage call. A provider actor that Ray is restarting (killed or
    preempted just before the restore: the usual moment for one) is asked again once it is back,
    for up to ``RESTARTING_WAIT_S``: staging only reads and holds, so asking twice is harmless."""
    ref = s.in_actors[(a.name, a.rank)]
    deadline = time.monotonic() + RESTARTING_WAIT_S
    while True:
        try:
            return ray.get(ref)
        except ray.exceptions.ActorUnavailableError as exc:
            if time.monotonic() >= deadline:
                return StagedState(False, None, f"provider actor still restarting after {RESTARTING_WAIT_S:g}s: "
                                                f"{one_line(exc)[:300]}")
            time.sleep(0.2)
            ref = s.in_actors[(a.name, a.rank)] = _stage_call(a, s.config)
        except ray.exceptions.RayError as exc:
            return StagedState(False, None, f"provider actor failed: {one_line(exc)[:300]}")


def _apply_call(a: ActorRead) -> Any:
    return a.provider.handle.__ray_call__.remote(apply_in_actor, a.provider.set, a.name, a.provider.attribute)


def _restarted(exc: BaseException) -> bool:
    """Whether an apply failed because Ray restarted the provider actor after its state was staged."""
    return isinstance(exc, ray.exceptions.ActorUnavailableError) or isinstance(
        getattr(exc, "cause", None), NothingStagedError)


def _restage_and_apply(s: Staged, a: ActorRead) -> None:
    """Stage ``a``'s state again in the restarted provider (verified again) and apply it there."""
    s.in_actors[(a.name, a.rank)] = _stage_call(a, s.config)
    r = _staged_result(s, a)
    if not r.ok:
        raise RestoreError(f"its provider actor was restarted during the restore, and staging again failed: {r.detail}")
    ray.get(_apply_call(a))


def _copy_tensors(state: Any) -> Any:
    """New containers and cloned tensors (DTensors stay DTensors on their mesh); other leaves shared."""
    import sys

    torch = sys.modules.get("torch")
    if isinstance(state, dict):
        return {k: _copy_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_tensors(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_copy_tensors(v) for v in state)
    if torch is not None and isinstance(state, torch.Tensor):
        return state.detach().clone()
    return state


def stage_sharded_in_actor(actor: Any, name: str, config: Any, entry: StateEntry, allow_pickle: bool,
                           getter: str, attribute: Optional[str]) -> StagedState:
    """Runs in a rank provider actor: a copy of its current state (the layout to fill: DTensors on
    this rank's mesh, any world size) is filled from the sharded state ``entry`` -- only the byte
    ranges of this rank's shards, each piece verified -- and held until every state verified.
    Keys, shapes and dtypes are checked against the checkpoint (strict); a mismatch fails the
    state, naming it. The provider's state must already hold every key (an optimizer's moments:
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` creates them)."""
    from ..storage.sharded_io import load_into_state

    try:
        target = _copy_tensors(actor_get(actor, getter, attribute, name))
        rep = load_into_state(tiers_of(config), entry, name, target, strict=True, allow_pickle=allow_pickle)
    except NoGoodCopy as exc:
        return StagedState(False, None, one_line(exc), unreadable=True)
    except (IntegrityError, RestoreError, OSError) as exc:
        return StagedState(False, None, one_line(exc))
    hold(actor, name, target)
    return StagedState(True, rep.tier, rep.detail, rep.bytes)


def verify(s: Staged, registry: Mapping[str, Registration], strict: bool, run: str) -> Dict[str, StateReport]:
    """Stage 3: the per-state reports. With ``strict``, raise RestoreError (after dropping every
    staged state) unless every CRITICAL / RELOADABLE state verified."""
    reports = dict(s.plan.reports)
    reports.update(s.reports)
    per_state: Dict[str, List[StagedState]] = {}
    for a in s.plan.actor_reads:
        name, rank = a.name, a.rank
        r = _staged_result(s, a)
        if rank is not None and r.detail:
            r = StagedState(r.ok, r.tier, f"rank {rank}: {r.detail}", r.bytes, r.unreadable)
        if r.unreadable:
            s.unreadable.add(name)
        per_state.setdefault(name, []).append(r)
    for name, rs in per_state.items():
        detail = "; ".join(r.detail for r in rs if r.detail)
        if all(r.ok for r in rs):
            tier = functools.reduce(farther, [r.tier or "local" for r in rs], "local")
            reports[name] = StateReport("restored", tier, True, detail, sum(r.bytes for r in rs))
        else:
            reports[name] = StateReport("missing", None, False, detail)
    failed = [n for n, r in reports.items()
              if r.status == "missing" and registry[n].strategy is not Strategy.BEST_EFFORT]
    if strict and failed:
        discard(s)
        m = s.plan.manifest
        error = NoCopyVerified if s.unreadable & set(failed) else RestoreError
        raise error(f"cannot restore {step_label(m.step, m.version)} of run {run!r}; nothing was loaded: "
                    + " | ".join(f"{n}: {reports[n].detail}" for n in failed))
    return reports


def discard(s: Staged) -> None:
    """Drop every state held in a provider actor by ``stage`` (a restore that will not apply)."""
    for a in s.plan.actor_reads:
        a.provider.handle.__ray_call__.remote(discard_in_actor, a.name)


def apply(s: Staged, reports: Mapping[str, StateReport], registry: Mapping[str, Registration], run: str) -> List[str]:
    """Stage 4: hand every verified state to its provider; returns the names loaded. A provider
    whose own set_state / loader raises is named in a RestoreError (with what was loaded)."""
    refused: List[str] = []
    loaded: List[str] = []
    applies = [(a, _apply_call(a)) for a in s.plan.actor_reads if reports[a.name].status == "restored"]
    for a, ref in applies:
        try:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not _restarted(exc):
                    raise
                _restage_and_apply(s, a)  # the actor was restarted since staging: its new process, once
            loaded.append(a.name)
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            refused.append(f"{a.name}{'' if a.rank is None else f' rank {a.rank}'}: {one_line(cause)[:300]}")
        except RestoreError as exc:
            refused.append(f"{a.name}{'' if a.rank is None else f' rank {a.rank}'}: {one_line(exc)[:300]}")
    calls = [(name, (state,)) for name, state in s.local.items()] + [(name, ()) for name in s.plan.reloads]
    for name, args in calls:
        try:
            registry[name].provider.loader(*args)
            loaded.append(name)
        except Exception as exc:
            refused.append(f"{name}: its loader raised {type(exc).__name__}: {one_line(exc)[:300]}")
    if refused:
        m = s.plan.manifest
        raise RestoreError(f"{step_label(m.step, m.version)} of run {run!r} verified, but loading it into "
                           f"its providers failed: {' | '.join(refused)}; loaded: "
                           f"{', '.join(sorted(set(loaded))) or 'nothing'}")
    return loaded
