"""CheckpointEngine: what drivers and actors use. ``save()`` returns a SaveHandle at once.

The driver submits each provider's snapshot itself (so Ray's per-caller ordering places it right
after that actor's training call for the same step) and passes the resulting ObjectRefs, inside a
list, to the coordinator: the driver never touches the bytes of an actor's state.

This module holds the public API and what ties it together (coordinator, owner lease, registry,
step counters); the work lives beside it: ``capture/calls.py`` (who captures each state),
``reading.py`` (load, restore), ``rank_push.py`` / ``push_batch.py`` (ranks' pushes),
``in_flight.py`` (backpressure), ``coordinator_client.py`` (starting and reviving the coordinator).
"""
from __future__ import annotations

import os
import time
import warnings
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Tuple, Union

import ray

from ..config import SIGNING_KEY_ENV, EngineConfig
from .coordinator_client import CoordinatorLink, ask_coordinator
from ..errors import CheckpointError, InvalidArgumentError, InvalidSaveError
from ..formats.manifest import Manifest
from .handle import SaveHandle, shared_wait
from .in_flight import InFlightSaves
from .preemption import PreemptionNotices
from ..coordinator.lease import OwnerLease
from ..coordinator.live_options import passed_options
from ..storage.ownership import DEFAULT_LEASE_S
from ..protocol import NAMESPACE, Declaration, actor_name, checked_metrics
from ..capture.providers import CallableProvider, Registration, resolve
from .push_batch import Pusher
from .rank_push import RankPushes, FencedObjects
from .reading import StateReader
from .run_lifetime import start_run, stop_run
from ..capture.mailbox import open_mailbox, prepare_mailbox
from ..capture.calls import announced, prefault, publish_calls, take_snapshots
from ..capture.gc_pause import collections_paused
from ..storage.layout import validate_name
from ..types import CheckpointMeta, OnBusy, RestoreReport, SaveResult, StateReport, Strategy


class CheckpointEngine(CoordinatorLink, InFlightSaves, RankPushes, PreemptionNotices):
    """Get one with ``create()`` (driver) or ``connect()`` (any process of the cluster)."""

    def __init__(self, coordinator: Any, config: EngineConfig):
        self._coordinator = coordinator
        self.config = config
        self.run = config.run
        self._registry: Dict[str, Registration] = {}
        self._in_flight: List[SaveHandle] = []
        self._ended_failures: Deque[BaseException] = deque(maxlen=16)  # for wait_until_finished()
        self._declared: Dict[str, Declaration] = {}
        self._fence_owners: Dict[Tuple[int, ...], FencedObjects] = {}
        self._mailbox_open = False
        self._last_pushed: Dict[tuple, int] = {}
        self._saves = 0  # save() calls sent; every remote_every-th is uploaded
        self._pushes: Dict[tuple, int] = {}  # submit() calls sent per (state, rank), likewise
        # this engine's pushes, batched per version into one coordinator call (push_batch.py)
        self._pusher = Pusher(lambda: self._coordinator, lambda c, v: shared_wait(c, v, fresh=True))
        self._owner = False  # set by create()
        self._closed = False  # set by shutdown()
        self._token: Optional[int] = None  # the run's fencing token this (creating) engine holds
        self._lease: Optional[OwnerLease] = None
        self.reconfigured: List[str] = []  # create(reconfigure=True): the live options it changed
        self._last_handle: Optional[SaveHandle] = None  # the latest save(), for publish()
        self._reader = StateReader(config.run, config, self._call, self._registry)  # load / load_into / restore
        last = ask_coordinator(config.run, coordinator.last_version.remote(), "the last version")
        self._last_saved = last
        self._step = max(last, 0)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, run: str, local_dir: str, remote_uri: Optional[str] = None, *,
               critical_writers: int = 2, best_effort_writers: int = 1,
               keep_last: Optional[int] = None, keep_every: Optional[int] = None,
               startup_timeout: float = 120.0, takeover: bool = False, owner_lease_s: float = DEFAULT_LEASE_S,
               reconfigure: bool = False, **options: Any) -> "CheckpointEngine":
        """Get-or-create the named coordinator of ``run`` and its writer pools.

        A run has one owner, the Ray job that created it (see ``storage/ownership.py``): ``create()`` from
        another live job — on this cluster or another one sharing the storage — raises
        ``rc.OwnershipError`` naming the owner; ``takeover=True`` takes the run over, and the old
        owner's later saves fail instead of committing. The owner renews its lease every
        ``owner_lease_s / 4`` seconds; a driver gone for ``owner_lease_s`` no longer holds the run.

        Other options: see ``EngineConfig`` (remote_options, keep_best,
        remote_keep_last, remote_every, max_in_flight, compression, critical_cpus, ...).

        On a run whose coordinator runs already (get-or-create), every option passed here (and
        ``local_dir`` / ``remote_uri`` always) must equal the running one: a difference raises
        ``InvalidArgumentError`` naming each option with both values (a signing key or remote
        credentials only as "differs"). Options not passed take the running run's values, so a
        restarted driver with the same code attaches as before. ``reconfigure=True`` changes the
        options that can change live (retention, ``rank_timeout_s``, ``signing_key``,
        ``max_in_flight``, ``compression``: ``live_options.LIVE``, where each is argued) on the
        running coordinator, logs them and lists them in ``engine.reconfigured``; any other
        difference still raises ("needs a new run") and nothing is changed."""
        named = {"critical_writers": critical_writers, "best_effort_writers": best_effort_writers,
                 "keep_last": keep_last, "keep_every": keep_every}
        passed = passed_options(named, options, os.environ.get(SIGNING_KEY_ENV))
        try:
            config = EngineConfig(run=run, local_dir=local_dir, remote_uri=remote_uri,
                                  critical_writers=critical_writers, best_effort_writers=best_effort_writers,
                                  keep_last=keep_last, keep_every=keep_every, **options)
        except TypeError as exc:
            raise InvalidArgumentError(f"CheckpointEngine.create: {exc}") from None
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        started = start_run(config, takeover=takeover, owner_lease_s=owner_lease_s, startup_timeout=startup_timeout,
                            passed=passed, reconfigure=bool(reconfigure))  # run_lifetime.py
        record = started.record
        engine = cls(started.coordinator, started.config)
        engine.reconfigured = started.reconfigured  # the options reconfigure=True changed (names)
        engine._owner = True  # the driver's engine brings the coordinator back if it is killed for good
        engine._token = record.token
        engine._call(lambda c: c.set_owner.remote(record.token), "the owner token")
        engine._lease = OwnerLease(started.tiers, record, run)
        if config.overlap:  # ranks' overlapped pushes announce their copies there: started meanwhile
            prepare_mailbox(started.coordinator, run)
        return engine

    @classmethod
    def connect(cls, run: str, timeout: float = 60.0) -> "CheckpointEngine":
        """Attach to the coordinator of an existing run (from any driver, task or actor)."""
        validate_name(run, "run name")
        if not ray.is_initialized():
            ray.init()
        try:
            coord = ray.get_actor(actor_name(run), namespace=NAMESPACE)
        except ValueError:
            raise CheckpointError(f"no checkpoint coordinator for run {run!r}; create it with "
                                  f"rc.CheckpointEngine.create({run!r}, local_dir=...)") from None
        return cls(coord, ask_coordinator(run, coord.config.remote(), "its configuration", timeout))

    def shutdown(self, timeout: float = 60.0, *, stop_coordinator: Optional[bool] = None) -> None:
        """Stop the coordinator; its writers (which it owns) and its peer replica holders stop too.
        The engine that created the run (``create()``) stops it; an engine from ``connect()`` (a
        rank, a tool) only detaches, so that a rank closing its engine does not stop checkpointing
        for the whole run, unless ``stop_coordinator=True`` (e.g. a detached coordinator whose
        driver is gone). Stopping first waits, at most ``timeout`` seconds, for the saves,
        retention deletions and uploads in progress, so that nothing still writes or deletes files
        once this returns; what did not end by then is logged as a warning and abandoned (a version
        whose commit did not happen is never listed). Committed checkpoints stay in storage.
        Calling it again does nothing; this engine's other methods raise ``CheckpointError``
        afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            self._pusher.close()  # parts pushed within the last window reach the coordinator first
            if not (self._owner if stop_coordinator is None else bool(stop_coordinator)):
                if self._lease is not None:
                    self._lease.stop(release_record=False)
                return
            refs = [h._ref for h in self._in_flight if h._ref is not None and not h.done()]
            stop_run(self._coordinator, self.run, refs, timeout, self._lease,  # run_lifetime.py
                     holders=self.config.may_hold_replicas)
        finally:  # the engine is held by a reference cycle: let go of the providers' actors now
            self._registry.clear()
            self._last_handle = None

    # ------------------------------------------------------------------ registration
    def register(self, name: str, provider: Any = None, *, strategy: Union[Strategy, str] = Strategy.CRITICAL,
                 loader: Optional[Callable[..., Any]] = None, allow_pickle: bool = False,
                 replace: bool = False, world_size: Optional[int] = None, replicated: bool = False,
                 overlap: Optional[bool] = None, append_only: bool = False) -> None:
        """Register a state. ``provider``: an actor handle (``ckpt_get_state`` / ``ckpt_set_state``),
        ``rc.actor_provider(handle, get=..., set=...)``, or an in-process callable returning the state
        (``loader(state)`` loads it back). A RELOADABLE state with a ``loader`` and no provider is not
        stored: restore calls ``loader()`` to rebuild it.

        ``world_size=N`` declares a state that N rank actors push themselves with
        ``rc.CheckpointEngine.connect(run).submit(step, name, state, rank=r)``; a version commits when
        every rank's part is durable. ``provider`` may then be the list of rank actor handles, so that
        ``restore()`` hands rank r its own part. ``replicated=True`` (DDP replicas) stores rank 0's
        copy once and restores it to every rank.

        ``overlap=True`` (default: ``create(..., overlap=...)``): ``save()``'s snapshot of this state
        only captures views of its memory and returns; the copy into the object store runs on a
        background thread of the provider's process, overlapping its next step. Before the state
        changes in place a fence waits for the copy: optimizers' step pre-hooks and BatchNorm
        forward pre-hooks do it by themselves; anything else calls ``rc.fence(name)`` first.

        ``append_only=True``: a buffer that only grows (a replay buffer): a dict of equally long
        numpy arrays with a strictly increasing integer ``row_id`` column, whose rows never change
        once saved and may be evicted anywhere. Each version writes only the rows whose ``row_id``
        is above the newest committed version's, plus a small index, and refers to the earlier
        versions' segment files for the rest (retention keeps a segment while a kept version needs
        it; a restore verifies every segment). See ``formats/segments.py``."""
        try:
            validate_name(name, "state name")
            strat = Strategy.parse(strategy)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if name in self._registry and not replace:
            raise InvalidArgumentError(f"state {name!r} is already registered; pass replace=True to "
                                       f"replace it (e.g. with a relaunched actor's new handle)")
        if not isinstance(append_only, bool):
            raise InvalidArgumentError(f"state {name!r}: append_only must be True or False, got {append_only!r}")
        if append_only and (strat is Strategy.RELOADABLE or replicated):
            raise InvalidArgumentError(f"state {name!r}: append_only=True is for a growing buffer (CRITICAL or "
                                       f"BEST_EFFORT), not for a {'replicated' if replicated else 'RELOADABLE'} state")
        if world_size is not None:
            self._register_pushed(name, provider, strat, world_size, replicated, allow_pickle, append_only)
            return
        prov = resolve(name, provider, strat, loader)
        if overlap is not None and not isinstance(overlap, bool):
            raise InvalidArgumentError(f"state {name!r}: overlap must be True, False or None, got {overlap!r}")
        overlapped = self.config.overlap if overlap is None else overlap
        if overlapped:
            open_mailbox(self.run)  # where the background copies announce their refs
        if append_only and isinstance(prov, CallableProvider) and prov.fn is None:
            raise InvalidArgumentError(f"state {name!r}: append_only=True needs a provider that returns the buffer")
        self._registry[name] = Registration(name, prov, strat, bool(allow_pickle), overlap=overlapped,
                                            append_only=append_only)
        prefault(self.config, prov, name, overlapped)  # capture/calls.py
        self._expect_driver()

    def unregister(self, name: str) -> None:
        """Stop saving state ``name`` from the next save on; its stored versions stay."""
        reg = self._registry.pop(name, None)
        if reg is None:
            raise InvalidArgumentError(f"state {name!r} is not registered")
        if reg.world_size is None:
            self._expect_driver()

    @property
    def registered(self) -> Dict[str, Strategy]:
        """The registered states and their strategies."""
        return {n: r.strategy for n, r in self._registry.items()}

    # ------------------------------------------------------------------ steps
    @property
    def current_step(self) -> int:
        """The step ``save()`` uses when called without one: the newest saved or advanced step."""
        return self._step

    @property
    def last_saved_step(self) -> int:
        """The newest step the run has used (committed, in flight, or lost with a node: a step is
        never used twice), -1 if none: the step of a save must be above it. After a restore from an
        older version it can be above the newest listed one (the versions after it were lost). As
        this engine knows it: the run's when it connected or restored, then its own saves and
        pushes (``submit``)."""
        return max(self._last_saved, max(self._last_pushed.values(), default=-1))

    def advance_step(self, n: int = 1) -> int:
        """Move ``current_step`` on by ``n`` and return it."""
        self._step += n
        return self._step

    # ------------------------------------------------------------------ saving
    def save(self, step: Optional[int] = None, *, on_busy: Union[OnBusy, str] = OnBusy.WAIT,
             metrics: Optional[Dict[str, float]] = None) -> SaveHandle:
        """Capture every registered state at ``step`` (default: current_step) and return at once."""
        t0 = time.perf_counter()
        self._check_open()
        step = self._step if step is None else step
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidSaveError(f"step must be a non-negative integer, got {step!r}")
        if step <= self._last_saved:
            raise InvalidSaveError(f"step {step} is not after the last saved step {self._last_saved} of run "
                                   f"{self.run!r}; steps must increase")
        try:
            policy = OnBusy.parse(on_busy)
        except ValueError as exc:
            raise InvalidSaveError(str(exc)) from None
        if not self._registry:
            raise InvalidSaveError("nothing to save: register at least one state (a provider here, or a "
                                   "state its ranks push with submit(), declared with world_size=N)")
        clean_metrics = checked_metrics(metrics)
        if self._owner and any(h.done() and h._coordinator_died() for h in self._in_flight):
            self._revive()  # an earlier save found the coordinator dead: this one goes to a new one
        if not self._make_room(policy):  # max_in_flight (in_flight.py)
            return SaveHandle(self, step, None, time.perf_counter() - t0, skipped=True)
        with collections_paused():  # a capture's short-lived containers: capture/gc_pause.py
            parts, refs = take_snapshots(self._registry, self.run, self.config)  # capture/calls.py
            self._saves += 1  # remote_every's turn is decided here: the coordinator runs concurrent calls in any order
            ref = self._coordinator.save.remote(step, parts, refs, clean_metrics,
                                                self._saves % self.config.remote_every == 0, token=self._token)
        self._last_saved = step
        self._step = max(self._step, step)
        handle = self._last_handle = SaveHandle(self, step, ref, time.perf_counter() - t0)
        handle._snapshots = {p.name: (r, announced(self._registry[p.name], r))  # calls.py
                             for p, r in zip([p for p in parts if not p.loader], refs)}
        self._in_flight.append(handle)
        return handle

    def publish(self, name: str, to: Iterable[Any], method: str, handle: Optional[SaveHandle] = None
                ) -> List[ray.ObjectRef]:
        """Hand the snapshot of state ``name`` (of ``handle``, default: the latest save) to each actor
        of ``to``: ``actor.<method>(state)`` runs with the bytes the save already holds in the object
        store (zero-copy on the same node), so the learner does not copy its weights again for the
        broadcast. Returns the calls' ObjectRefs at once; overlapped states work too."""
        self._check_open()
        return publish_calls(handle or self._last_handle, name, to, method)

    def wait_all(self, timeout: Optional[float] = None) -> List[SaveResult]:
        """The older name of ``wait_until_finished()``."""
        warnings.warn("engine.wait_all() is deprecated; call engine.wait_until_finished()", DeprecationWarning,
                      stacklevel=2)
        return self.wait_until_finished(timeout)

    def wait_until_finished(self, timeout: Optional[float] = None) -> List[SaveResult]:
        """Block until every save and push this engine issued has ended (as Orbax's
        ``CheckpointManager.wait_until_finished``); returns the committed ones' results.

        Raises the first failure among the saves that ended since the previous call, after waiting
        for all of them: a save that failed in the background is never forgotten, even when its
        handle was dropped. ``timeout`` bounds the whole wait (a SaveError naming the step)."""
        return self._wait_in_flight(timeout)  # in_flight.py

    # ------------------------------------------------------------------ reading
    def list_checkpoints(self) -> List[CheckpointMeta]:
        return self._call(lambda c: c.list.remote(), "the list of checkpoints")

    def all_steps(self) -> List[int]:
        """The steps of the committed versions, oldest first (Orbax's ``all_steps``)."""
        return [m.step for m in self.list_checkpoints()]

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None when the run has none (Orbax's ``latest_step``)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def skipped_versions(self) -> Dict[int, str]:
        """The versions the run no longer lists, with why: lost with a node, rolled back behind the
        engine's back, or found in storage and not trusted. Their steps are never used again (the
        coordinator refuses a step up to the newest of them that is not committed)."""
        return self._call(lambda c: c.skipped_versions.remote(), "the skipped versions")

    def _manifest(self, version: int = -1, step: Optional[int] = None) -> Manifest:
        return self._reader.manifest(version, step)

    def load(self, name: Any = None, step: Any = -1, rank: Optional[int] = 0, *, version: Optional[int] = None,
             allow_pickle: Optional[bool] = None, with_report: bool = False) -> Any:
        """Read one state of a committed version into this process (verified against the
        manifest, local tier first, then remote), without touching any provider.

        ``step=-1``: the latest version (versions are steps). ``rank``: which rank's part of a
        pushed state; ``rank=None``: a sharded (DTensor) state with every DTensor leaf assembled
        into its full tensor from all ranks' chunks (ranged reads, each piece verified), or the
        single part of a state that has one. ``with_report=True`` returns ``(state, StateReport)``:
        the tier it was read from (a missing or corrupt local copy read from a peer or the remote tier
        says so in ``detail``) and the bytes read. The older form ``load(version, name, rank)`` still
        works."""
        if isinstance(name, int) and not isinstance(name, bool) and isinstance(step, str):
            warnings.warn("engine.load(version, name) is deprecated; call engine.load(name, step=version)",
                          DeprecationWarning, stacklevel=2)
            name, step = step, name
        if version is not None:
            step = version
        return self._reader.load(name, step, rank, allow_pickle, with_report)

    def load_into(self, name: str, state: Any, step: int = -1, rank: int = 0, *, strict: bool = True,
                  world_size: Optional[int] = None, allow_pickle: Optional[bool] = None) -> StateReport:
        """Fill ``state`` (e.g. ``model.state_dict()`` / ``optim.state_dict()`` of this rank) in
        place from state ``name`` of a committed version; returns a ``StateReport`` (tier read,
        bytes read, skipped keys).

        A sharded state (saved with DTensor leaves) is resharded: each DTensor leaf of ``state``,
        on any mesh and any world size, gets its local shard, read as the byte ranges it overlaps
        from each stored file (each piece verified; a corrupt local piece is read from the remote
        tier), plain tensor leaves and scalars (AdamW's ``step``, param_groups) come from rank 0's
        part. A state of plain tensors pushed per rank is rank-local: ``rank``'s part is loaded,
        and a ``world_size`` other than the number of ranks that saved it is a RestoreError naming
        both, raised before anything changes (``world_size`` defaults to torch.distributed's when
        a process group is initialised).

        Keys, shapes and dtypes are checked before any tensor of ``state`` changes: a mismatch is
        a RestoreError naming it; ``strict=False`` skips keys missing on either side and names them
        in the report's detail. Only tensors and scalars are filled: call ``load_state_dict`` after
        it for objects that keep state elsewhere."""
        return self._reader.load_into(name, state, step, rank, strict, world_size, allow_pickle)

    def restore(self, step: int = -1, strict: bool = True, names: Optional[Iterable[str]] = None,
                rewind: bool = False, fallback: bool = False) -> RestoreReport:
        """Bring registered providers back to a committed version (-1: the latest).

        Every file is verified against the manifest before use, read from the local tier first and
        from the remote tier when the local copy is missing or corrupt. With ``strict=True`` nothing
        is loaded into any provider unless every CRITICAL / RELOADABLE state verified.

        A listed version is one that some copy can restore. When a critical file of the version
        tried has no good copy on any tier this process reads, the coordinator checks every copy
        it can reach; if none verifies, the version is no longer listed (``status()`` says why) and
        a plain ``restore()`` goes on to the newest version listed then, its report's
        ``skipped_versions`` naming the one passed over. If the coordinator still finds a copy
        (or one it cannot check, on another node's disk), the restore refuses, loading nothing.
        ``fallback=True`` (with ``step=-1``): restore the newest version that verifies here,
        passing over (and naming) any newer one that does not.

        Versions are steps, so after restoring an older version, saves must go past the newest
        one. ``rewind=True`` instead deletes every version newer than the restored one (after the
        restore succeeded), and training goes on from it with the same step numbers."""
        report = self._reader.restore(step, strict, names, rewind, fallback)  # reading.py
        self._last_saved = report.step if rewind else max(self._last_saved, report.step)
        self._step = report.step
        return report

    def status(self) -> Dict[str, Any]:
        """Saves in flight with each part's stage, queued bytes per pool, the last error."""
        out = self._call(lambda c: c.status.remote(), "its status").to_dict()
        if self.config.remote_uri and (self._owner or self._saves):
            # this engine counts the saves that take the upload turns: 1 = its next save is uploaded
            every = self.config.remote_every
            out["saves_until_upload"] = 1 if out.get("upload_owed") else every - self._saves % every
        return out
