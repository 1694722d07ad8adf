"""CheckpointEngine: what drivers and actors use. ``save()`` returns a SaveHandle at once.

The driver submits each provider's snapshot itself (so Ray's per-caller ordering places it right
after that actor's training call for the same step) and passes the resulting ObjectRefs, inside a
list, to the coordinator: the driver never touches the bytes of an actor's state.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import restore as stages
from . import sharded_io
from .checkpoint_io import rank_files
from .config import EngineConfig
from .coordinator import NAMESPACE, CoordinatorActor, actor_name
from .errors import (CheckpointError, IntegrityError, InvalidArgumentError, InvalidSaveError, RestoreError,
                     SaveError, one_line)
from .formats.manifest import Manifest
from .lease import OwnerLease, job_alive, ray_identity, read_owner, write_owner
from .metrics import for_run as metrics_for_run
from .object_store import prefault_in_actor, start_prefault
from .ownership import DEFAULT_LEASE_S, claim
from .protocol import Declaration, PartPlan, SaveOutcome
from .providers import Registration, rank_provider, resolve
from .snapshot import ActorProvider, CallableProvider, capture, read_state, snapshot_in_actor, tiers_of
from .storage.layout import validate_name
from .types import CheckpointMeta, OnBusy, RestoreReport, SaveResult, StateReport, Strategy

log = logging.getLogger("ray_ckpt")

_HEAD_RESOURCE = "node:__internal_head__"  # Ray's marker resource of the head node


def _coordinator_placement() -> Dict[str, Any]:
    """Where the coordinator runs: on the head node where Ray marks it — worker nodes are the
    preemptible ones, and a coordinator that dies with one fails the saves in flight — else next
    to this process. (A soft node-affinity request alone was not honoured for this num_cpus=0
    detached actor: on a 3-node ``Cluster`` it landed on a worker.)"""
    if _HEAD_RESOURCE in ray.cluster_resources():
        return {"resources": {_HEAD_RESOURCE: 0.001}}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                  soft=True)}


_WAITS: "OrderedDict[tuple, ray.ObjectRef]" = OrderedDict()  # see _shared_wait
_WAITS_LOCK = threading.Lock()
_WAITS_MAX = 4096


def _shared_wait(coord: Any, version: int, durability: str = "local", best_effort: bool = False,
                 pushed: bool = True, fresh: bool = False) -> ray.ObjectRef:
    """ONE ``coordinator.wait(version, durability)`` call per (coordinator, version, durability) in
    this process, shared by every handle that waits on it: a host process pushing 300 ranks costs
    the coordinator one waiting call per version, not 300. (Waiting calls are coroutines in the
    coordinator; they hold no slot the parts need, but thousands of them would still be thousands
    of calls.) ``fresh``: a new push for ``version`` — a cached call that already ended (the
    version committed or failed before) is replaced, since the push starts a new attempt."""
    key = (coord._actor_id.hex(), version, durability, best_effort, pushed)
    with _WAITS_LOCK:
        ref = _WAITS.get(key)
        if ref is not None and fresh and ray.wait([ref], timeout=0)[0]:
            ref = None
        if ref is None:
            ref = coord.wait.remote(version, durability, best_effort, pushed)
            _WAITS[key] = ref
            while len(_WAITS) > _WAITS_MAX:
                _WAITS.popitem(last=False)
        else:
            _WAITS.move_to_end(key)
        return ref


class SaveHandle:
    """The future of one save. ``wait()`` raises SaveError on failure: never silent.

    It follows ``concurrent.futures.Future``: ``result(timeout)``, ``done()``, ``exception()``,
    ``add_done_callback(fn)``, and ``await handle`` in asyncio code; ``wait()`` is the form that
    also waits for the remote tier (``durability="remote"``) or for best-effort parts.

    A rank's handle (``submit()``) holds two refs: ``_ack``, the coordinator's answer that the part
    was accepted (a rejected push raises from it), and ``_ref``, the version's commit, shared with
    every other handle of this process waiting on the same version (``_shared_wait``)."""

    def __init__(self, engine: "CheckpointEngine", step: int, ref: Optional[ray.ObjectRef],
                 submit_s: float, skipped: bool = False, ack: Optional[ray.ObjectRef] = None,
                 rank_zero_only: bool = False):
        self._engine = engine
        self._coordinator = engine._coordinator  # the one this save went to
        self.step = step
        self.version: Optional[int] = None if skipped else step
        self._ref = ref
        self._ack = ack
        self._rank_zero_only = rank_zero_only
        self._remote_ref = None
        self.submit_seconds = submit_s  # how long save() took to return
        self.skipped = skipped

    def _ack_failed(self) -> bool:
        """Whether a rank's push was rejected (only once its ack arrived; never blocks)."""
        if self._ack is None or not ray.wait([self._ack], timeout=0)[0]:
            return False
        try:
            ray.get(self._ack, timeout=0)
        except Exception:
            return True
        return False

    def _coordinator_died(self) -> bool:
        """Whether this (finished) save failed because its coordinator died for good."""
        try:
            ray.get(self._ref, timeout=0)
        except ray.exceptions.ActorDiedError:
            return self._engine._coordinator is self._coordinator
        except Exception:
            pass
        return False

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"SaveHandle(step={self.step}, {state})"

    def done(self) -> bool:
        """True once the local commit finished (or failed, or the push was rejected); never blocks."""
        if self._ref is None:
            return True
        if self._ack is not None:
            if not ray.wait([self._ack], timeout=0)[0]:
                return False
            if self._ack_failed():
                return True
        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: Optional[float] = None, durability: str = "local",
             best_effort: bool = False) -> SaveResult:
        """Block until the version is committed on the ``durability`` tier ("local" or "remote").

        ``best_effort=True`` also waits for the version's best-effort parts to be written or
        reported missing (a commit never waits for them)."""
        if self.skipped:
            return SaveResult(None, self.step, 0, "skipped")
        if durability not in ("local", "remote"):
            raise InvalidArgumentError(f"durability must be 'local' or 'remote', got {durability!r}")
        coord = self._engine._coordinator
        pushed = self._ack is not None
        if best_effort:
            ref = _shared_wait(coord, self.version, durability, True, pushed) if pushed else \
                coord.wait.remote(self.version, durability, True)
        elif durability == "local":
            ref = self._ref
        else:
            if self._remote_ref is None:
                self._remote_ref = _shared_wait(coord, self.version, "remote", pushed=pushed) if pushed else \
                    coord.wait.remote(self.version, "remote")
            ref = self._remote_ref
        try:
            if self._ack is not None:  # a rejected push raises its own error, not the version's
                t0 = time.monotonic()
                ray.get(self._ack, timeout=timeout)
                if timeout is not None:
                    timeout = max(0.0, timeout - (time.monotonic() - t0))
            d = ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            detail = ""
            if durability == "remote":
                try:
                    err = ray.get(coord.remote_error.remote(self.version), timeout=10)
                    detail = f"; last upload error: {err}" if err else "; upload still in progress"
                except Exception:
                    pass
            raise SaveError(f"version {self.version} (step {self.step}) of run {self._engine.run!r} is not "
                            f"durable on the {durability} tier after {timeout}s{detail}") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            revived = isinstance(exc, ray.exceptions.ActorDiedError) and (
                self._engine._coordinator is not self._coordinator or self._engine._revive())
            raise SaveError(f"the coordinator of run {self._engine.run!r} died while version {self.version} was in "
                            f"flight; its outcome is lost (listed only if its manifest was written before) "
                            f"({one_line(exc)[:200]})"
                            + ("; a new coordinator was created: later saves go to it" if revived else "")) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise (type(cause) if isinstance(cause, SaveError) else SaveError)(one_line(cause)) from None
        if self._rank_zero_only:  # a replica rank's push: rank 0's copy is the one stored
            d = dataclasses.replace(d, rank_zero_only=True)
        return d.result()

    # ------------------------------------------------------------------ concurrent.futures.Future style
    def result(self, timeout: Optional[float] = None) -> SaveResult:
        """The local commit's SaveResult (as ``wait(timeout)``); raises SaveError on failure."""
        return self.wait(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The error the save failed with, or None once it committed (waits up to ``timeout``)."""
        try:
            self.wait(timeout)
        except SaveError as exc:
            if "is not durable on the local tier after" in str(exc):
                raise TimeoutError(str(exc)) from None
            return exc
        return None

    def add_done_callback(self, fn: Callable[["SaveHandle"], Any]) -> None:
        """Call ``fn(handle)`` once the local commit finished or failed (at once if it has); from a
        background thread, as ``concurrent.futures`` does for a future that is not done yet."""
        if self.done():
            fn(self)
            return
        import threading

        def watch():
            if self._ack is not None:
                ray.wait([self._ack], num_returns=1, timeout=None)
            if not self._ack_failed():
                ray.wait([self._ref], num_returns=1, timeout=None)
            fn(self)

        threading.Thread(target=watch, name=f"ray_ckpt-done-{self.step}", daemon=True).start()

    def __await__(self):
        import asyncio

        return asyncio.get_event_loop().run_in_executor(None, self.wait).__await__()


class CheckpointEngine:
    """Get one with :meth:`create` (driver) or :meth:`connect` (any process of the cluster)."""

    def __init__(self, coordinator: Any, config: EngineConfig):
        self._coordinator = coordinator
        self.config = config
        self.run = config.run
        self._registry: Dict[str, Registration] = {}
        self._in_flight: List[SaveHandle] = []
        self._declared: Dict[str, Declaration] = {}
        self._last_pushed: Dict[tuple, int] = {}
        self._saves = 0  # save() calls sent; every remote_every-th is uploaded
        self._pushes: Dict[tuple, int] = {}  # submit() calls sent per (state, rank), likewise
        self._push_waits: Dict[int, Any] = {}  # version -> its shared commit ref, while this engine's pushes wait
        self._owner = False  # set by create()
        self._closed = False  # set by shutdown()
        self._token: Optional[int] = None  # the run's fencing token this (creating) engine holds
        self._lease: Optional[OwnerLease] = None
        last = _ask(config.run, coordinator.last_version.remote(), "the last version")
        self._last_saved = last
        self._step = max(last, 0)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, run: str, local_dir: str, remote_uri: Optional[str] = None, *,
               critical_writers: int = 2, best_effort_writers: int = 1,
               keep_last: Optional[int] = None, keep_every: Optional[int] = None,
               startup_timeout: float = 120.0, takeover: bool = False, owner_lease_s: float = DEFAULT_LEASE_S,
               **options: Any) -> "CheckpointEngine":
        """Get-or-create the named coordinator of ``run`` and its writer pools.

        A run has one owner, the Ray job that created it (see ``ownership.py``): ``create()`` from
        another live job — on this cluster or another one sharing the storage — raises
        ``rc.OwnershipError`` naming the owner; ``takeover=True`` takes the run over, and the old
        owner's later saves fail instead of committing. The owner renews its lease every
        ``owner_lease_s / 4`` seconds; a driver gone for ``owner_lease_s`` no longer holds the run.

        Other options: see :class:`~ray_ckpt.config.EngineConfig` (remote_options, keep_best,
        remote_keep_last, remote_every, max_in_flight, compression, critical_cpus, ...)."""
        try:
            config = EngineConfig(run=run, local_dir=local_dir, remote_uri=remote_uri,
                                  critical_writers=critical_writers, best_effort_writers=best_effort_writers,
                                  keep_last=keep_last, keep_every=keep_every, **options)
        except TypeError as exc:
            raise InvalidArgumentError(f"CheckpointEngine.create: {exc}") from None
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        # fail fast, in the caller, on tiers that cannot be written (bad path, wrong credentials)
        config.local_tier().check_writable()
        if config.remote_uri:
            config.remote_tier().check_writable()
        if not isinstance(owner_lease_s, (int, float)) or isinstance(owner_lease_s, bool) or owner_lease_s <= 0:
            raise InvalidArgumentError(f"owner_lease_s must be a number of seconds > 0, got {owner_lease_s!r}")
        if not ray.is_initialized():
            ray.init()
        tiers = [config.local_tier()] + ([config.remote_tier()] if config.remote_uri else [])
        cluster, job = ray_identity()
        record = claim(read_owner(tiers), cluster, job, takeover=bool(takeover), run=run,
                       lease_s=float(owner_lease_s), job_alive=job_alive)
        write_owner(tiers, record)
        try:
            coord, existing = _open_coordinator(config, startup_timeout)
        except ray.exceptions.GetTimeoutError:
            raise CheckpointError(f"the coordinator of run {run!r} or its writers did not start within "
                                  f"{startup_timeout}s (are there enough CPUs for critical_cpus / "
                                  f"best_effort_cpus?)") from None
        except ray.exceptions.RayActorError as exc:
            raise CheckpointError(f"the coordinator of run {run!r} could not start: "
                                  f"{one_line(exc)[:500]}") from None
        if (existing.local_dir, existing.remote_uri) != (config.local_dir, config.remote_uri):
            raise InvalidArgumentError(
                f"run {run!r} already has a coordinator with local_dir={existing.local_dir!r}, "
                f"remote_uri={existing.remote_uri!r}; connect() to it or shut it down first")
        engine = cls(coord, existing)
        engine._owner = True  # the driver's engine brings the coordinator back if it is killed for good
        engine._token = record.token
        engine._call(lambda c: c.set_owner.remote(record.token), "the owner token")
        engine._lease = OwnerLease(tiers, record, run)
        return engine

    def _call(self, method: Callable[[Any], Any], what: str, timeout: float = 60.0,
              error: type = CheckpointError) -> Any:
        """Call the coordinator (``method(handle)`` returns the ref); if it died for good, the
        owning engine creates it again and asks once more."""
        self._check_open()
        try:
            return _ask(self.run, method(self._coordinator), what, timeout, error)
        except CheckpointError as exc:
            if not getattr(exc, "actor_died", False) or not self._revive():
                raise
        return _ask(self.run, method(self._coordinator), what, timeout, error)

    def _revive(self) -> bool:
        """The coordinator died for good (``ray.kill`` without restart, or its restarts exhausted):
        the engine that created it creates it again by name; the new one rebuilds its catalogue
        from storage. Engines from ``connect()`` (ranks) leave that to the driver, and nothing
        revives a coordinator after ``shutdown()``. Returns whether a new coordinator answers."""
        if not self._owner or self._closed:
            return False
        log.warning("the coordinator of run %r is gone; creating it again from storage", self.run)
        try:
            self._coordinator, _ = _open_coordinator(self.config, 120.0)
            if self._token is not None:
                ray.get(self._coordinator.set_owner.remote(self._token), timeout=60)
        except ray.exceptions.RayError as exc:
            log.error("the coordinator of run %r could not be created again: %s", self.run, one_line(exc)[:300])
            return False
        return True

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
        return cls(coord, _ask(run, coord.config.remote(), "its configuration", timeout))

    def shutdown(self, timeout: float = 60.0, *, stop_coordinator: Optional[bool] = None) -> None:
        """Stop the coordinator; its writers, which it owns, stop with it. The engine that created the
        run (``create()``) stops it; an engine from ``connect()`` (a rank, a tool) only detaches, so
        that a rank closing its engine does not stop checkpointing for the whole run, unless
        ``stop_coordinator=True`` (e.g. to stop a detached coordinator whose driver is gone).

        Stopping first waits, at most
        ``timeout`` seconds, for the saves, retention deletions and uploads in progress to end, so
        that nothing still writes or deletes files once this returns; what did not end by then is
        logged as a warning and abandoned (a version whose commit did not happen is never listed).
        Committed checkpoints stay in storage. Calling it again does nothing; this engine's other
        methods raise ``CheckpointError`` afterwards."""
        if self._closed:
            return
        self._closed = True
        if not (self._owner if stop_coordinator is None else bool(stop_coordinator)):
            if self._lease is not None:
                self._lease.stop(release_record=False)
            return
        deadline = time.monotonic() + timeout
        # this engine's saves first: the coordinator may not have started one that was just called
        # (it runs concurrent calls in any order), so quiesce() alone could miss it
        refs = [h._ref for h in self._in_flight if h._ref is not None and not h.done()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout)
        try:
            left = max(0.0, deadline - time.monotonic())
            unfinished = ray.get(self._coordinator.quiesce.remote(left), timeout=left + 30)
        except ray.exceptions.RayError as exc:  # already gone, or stuck (GetTimeoutError)
            unfinished = [f"the coordinator did not answer ({one_line(exc)[:200]})"]
        if unfinished:
            log.warning("shutting down run %r with work unfinished after %.0fs: %s", self.run, timeout,
                        "; ".join(unfinished))
        ray.kill(self._coordinator, no_restart=True)
        if self._lease is not None:  # the run is free for another job at once
            self._lease.stop(release_record=True)
        # ray.kill only asks: wait (bounded) until the coordinator is gone, so that nothing of this
        # run still runs when shutdown() returns and a new engine of the same run starts afresh
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get(self._coordinator.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                return
            except ray.exceptions.GetTimeoutError:
                break
            time.sleep(0.05)
        log.warning("the coordinator of run %r had not stopped 30s after shutdown()", self.run)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this engine of run {self.run!r} was shut down; CheckpointEngine.create() "
                                  f"or connect() gives a new one (committed checkpoints are still in storage)")

    # ------------------------------------------------------------------ registration
    def register(self, name: str, provider: Any = None, *, strategy: Union[Strategy, str] = Strategy.CRITICAL,
                 loader: Optional[Callable[..., Any]] = None, allow_pickle: bool = False,
                 replace: bool = False, world_size: Optional[int] = None, replicated: bool = False) -> None:
        """Register a state. ``provider``: an actor handle (``ckpt_get_state`` / ``ckpt_set_state``),
        ``rc.actor_provider(handle, get=..., set=...)``, or an in-process callable returning the state
        (``loader(state)`` loads it back). A RELOADABLE state with a ``loader`` and no provider is not
        stored: restore calls ``loader()`` to rebuild it.

        ``world_size=N`` declares a state that N rank actors push themselves with
        ``rc.CheckpointEngine.connect(run).submit(step, name, state, rank=r)``; a version commits when
        every rank's part is durable. ``provider`` may then be the list of rank actor handles, so that
        ``restore()`` hands rank r its own part. ``replicated=True`` (DDP replicas) stores rank 0's
        copy once and restores it to every rank."""
        try:
            validate_name(name, "state name")
            strat = Strategy.parse(strategy)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if name in self._registry and not replace:
            raise InvalidArgumentError(f"state {name!r} is already registered; pass replace=True to "
                                       f"replace it (e.g. with a relaunched actor's new handle)")
        if world_size is not None:
            self._register_pushed(name, provider, strat, world_size, replicated, allow_pickle)
            return
        prov = resolve(name, provider, strat, loader)
        self._registry[name] = Registration(name, prov, strat, bool(allow_pickle))
        self._prefault(prov)

    def _prefault(self, prov: Union[ActorProvider, CallableProvider]) -> None:
        """With ``prefault_object_store``: the process that will copy this state's snapshots into the
        object store (the provider actor; this one for an in-process callable) maps it now, in the
        background."""
        if not self.config.prefault_object_store:
            return
        if isinstance(prov, ActorProvider):
            prov.handle.__ray_call__.remote(prefault_in_actor)  # returns at once; no answer needed
        elif prov.fn is not None:
            start_prefault()

    def _register_pushed(self, name, provider, strat, world_size, replicated, allow_pickle) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise InvalidArgumentError(f"state {name!r}: world_size must be an integer >= 1, got {world_size!r}")
        handles = None
        if provider is not None:
            items = list(provider) if isinstance(provider, (list, tuple)) else None
            if items is None or len(items) != world_size:
                raise InvalidArgumentError(f"state {name!r}: with world_size={world_size}, provider must be "
                                           f"None or a list of {world_size} rank actor handles")
            handles = [rank_provider(name, h) for h in items]
        self._call(lambda c: c.declare.remote(name, strat.value, world_size, bool(replicated), bool(allow_pickle)),
                   f"declaring {name!r}")
        self._registry[name] = Registration(name, None, strat, bool(allow_pickle), world_size, handles,
                                            bool(replicated))
        # ranks push from their own processes: submit() starts their prefault

    def submit(self, step: int, name: str, state: Any, rank: int = 0, *,
               on_busy: Union[OnBusy, str] = OnBusy.WAIT) -> SaveHandle:
        """Push this rank's part of a declared state for ``step`` (from inside a rank actor).

        Returns once the coordinator accepted the part (a bad push raises here: an undeclared state,
        a rank out of range, a part pushed twice), with a handle; the version commits when every
        declared rank has pushed. One engine may push for many ranks (a host process of several
        ranks): their handles share one wait call per version.

        Backpressure: at most ``max_in_flight`` of this engine's versions are in flight (pushes
        for a version already in flight always go). ``on_busy``: "wait" (block until the oldest
        ends; push every rank of a version before the next version, or this waits for a version
        that cannot commit until ``rank_timeout_s``), "skip" (return a skipped handle, nothing
        captured) or "queue" (push anyway)."""
        t0 = time.perf_counter()
        self._check_open()
        try:
            policy = OnBusy.parse(on_busy)
        except ValueError as exc:
            raise InvalidSaveError(str(exc)) from None
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidSaveError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidSaveError(f"rank must be a non-negative integer, got {rank!r}")
        decl = self._declared.get(name)
        if decl is None:
            self._declared = self._call(lambda c: c.declared.remote(), "the declared states")
            decl = self._declared.get(name)
        if decl is None:
            raise InvalidSaveError(f"state {name!r} is not declared for pushing in run {self.run!r}; the "
                                   f"driver registers it with engine.register({name!r}, world_size=N)")
        if rank >= decl.world_size:
            raise InvalidSaveError(f"rank {rank} is out of range for state {name!r} (world_size {decl.world_size})")
        last = self._last_pushed.get((name, rank), -1)
        if step <= last:
            raise InvalidSaveError(f"state {name!r} rank {rank}: step {step} is not after its last submitted "
                                   f"step {last}; steps must increase")
        busy = [v for v in self._pushes_in_flight() if v != step]
        if len(busy) >= self.config.max_in_flight and policy is not OnBusy.QUEUE:
            if policy is OnBusy.SKIP:
                return SaveHandle(self, step, None, time.perf_counter() - t0, skipped=True)
            ray.wait([self._push_waits[v] for v in busy], num_returns=len(busy) - self.config.max_in_flight + 1)
            self._pushes_in_flight()
        rank_zero_only = decl.replicated and rank != 0
        if rank_zero_only:
            ref = None  # replicas: rank 0's copy is stored; this rank's handle follows the version
        else:
            if self.config.prefault_object_store:
                start_prefault()  # once per process; this rank's later copies land in mapped pages
            flat = capture(state, name, decl.allow_pickle)
            ref = ray.put(flat)
        pushes = self._pushes[(name, rank)] = self._pushes.get((name, rank), 0) + 1
        ack = self._coordinator.submit.remote(step, name, rank, [ref] if ref is not None else [], 0,
                                              pushes % self.config.remote_every == 0, last)
        self._last_pushed[(name, rank)] = step
        commit = self._push_waits.get(step)
        if commit is None:  # this engine's first push of the version: a new attempt, if it ran before
            commit = self._push_waits[step] = _shared_wait(self._coordinator, step, fresh=True)
        handle = SaveHandle(self, step, commit, time.perf_counter() - t0, ack=ack, rank_zero_only=rank_zero_only)
        self._in_flight.append(handle)
        return handle

    def _pushes_in_flight(self) -> List[int]:
        """This engine's pushed versions not yet committed or failed; forgets the others' handles.
        One ``ray.wait`` over at most ``max_in_flight`` + 1 refs: O(1) per submit, however many
        ranks this engine pushes for."""
        if not self._push_waits:
            return []
        refs = list(self._push_waits.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if ready:
            ended = {v for v, r in self._push_waits.items() if r in ready}
            for v in ended:
                del self._push_waits[v]
            self._in_flight = [h for h in self._in_flight if h._ack is None or h.version not in ended]
        return sorted(self._push_waits)

    def unregister(self, name: str) -> None:
        if self._registry.pop(name, None) is None:
            raise InvalidArgumentError(f"state {name!r} is not registered")

    @property
    def registered(self) -> Dict[str, Strategy]:
        return {n: r.strategy for n, r in self._registry.items()}

    # ------------------------------------------------------------------ steps
    @property
    def current_step(self) -> int:
        return self._step

    def advance_step(self, n: int = 1) -> int:
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
        if not any(r.world_size is None for r in self._registry.values()):
            raise InvalidSaveError("nothing to save from the driver: register at least one state with a "
                                   "provider (pushed states are saved by their ranks with submit())")
        clean_metrics = _check_metrics(metrics)
        if self._owner and any(h.done() and h._coordinator_died() for h in self._in_flight):
            self._revive()  # an earlier save found the coordinator dead: this one goes to a new one
        self._in_flight = [h for h in self._in_flight if not h.done()]
        if len(self._in_flight) >= self.config.max_in_flight:
            if policy is OnBusy.SKIP:
                return SaveHandle(self, step, None, time.perf_counter() - t0, skipped=True)
            if policy is OnBusy.WAIT:
                ray.wait([h._ref for h in self._in_flight], num_returns=len(self._in_flight)
                         - self.config.max_in_flight + 1)
                self._in_flight = [h for h in self._in_flight if not h.done()]
        parts: List[PartPlan] = []
        refs: List[ray.ObjectRef] = []
        # in-process states first: an unsupported object raises here, before anything is submitted
        for reg in self._registry.values():
            prov = reg.provider
            if reg.world_size is not None:
                continue  # pushed by its ranks; the coordinator expects those parts itself
            if isinstance(prov, CallableProvider):
                if prov.fn is None:
                    parts.append(PartPlan(reg.name, reg.strategy, loader=True))
                    continue
                t_pause = time.perf_counter()
                flat = capture(prov.fn(), reg.name, reg.allow_pickle)
                parts.append(PartPlan(reg.name, reg.strategy, nbytes=flat.nbytes))
                refs.append(ray.put(flat))
                metrics_for_run(self.run).snapshot_pause(time.perf_counter() - t_pause, state=reg.name)
        for reg in self._registry.values():
            prov = reg.provider
            if isinstance(prov, ActorProvider):
                parts.append(PartPlan(reg.name, reg.strategy))
                refs.append(prov.handle.__ray_call__.options(name=f"ray_ckpt.snapshot:{self.run}/{reg.name}").remote(
                    snapshot_in_actor, prov.get, reg.name, reg.allow_pickle, self.config.prefault_object_store,
                    prov.attribute, self.run))
        self._saves += 1
        # remote_every counts this engine's saves, in call order: the coordinator runs concurrent calls
        # in any order, so the turn is decided here
        ref = self._coordinator.save.remote(step, parts, refs, clean_metrics,
                                            self._saves % self.config.remote_every == 0, token=self._token)
        self._last_saved = step
        self._step = max(self._step, step)
        handle = SaveHandle(self, step, ref, time.perf_counter() - t0)
        self._in_flight.append(handle)
        return handle

    def wait_all(self, timeout: Optional[float] = None) -> List[SaveResult]:
        """Wait for every save of this engine still in flight."""
        out = [h.wait(timeout) for h in self._in_flight]
        self._in_flight = []
        return out

    # ------------------------------------------------------------------ reading
    def list_checkpoints(self) -> List[CheckpointMeta]:
        return self._call(lambda c: c.list.remote(), "the list of checkpoints")

    def _manifest(self, version: int = -1, step: Optional[int] = None) -> Manifest:
        m = self._call(lambda c: c.manifest.remote(version, step), "a manifest", error=RestoreError)
        if m is None:
            what = "" if version == -1 and step is None else (
                f" at step {step}" if step is not None else f" with version {version}")
            raise RestoreError(f"run {self.run!r} has no committed checkpoint{what}")
        return m

    def load(self, name: Any = None, step: Any = -1, rank: Optional[int] = 0, *, version: Optional[int] = None,
             allow_pickle: Optional[bool] = None) -> Any:
        """Read one state of a committed version into this process (verified against the
        manifest, local tier first, then remote), without touching any provider.

        ``step=-1``: the latest version (versions are steps). ``rank``: which rank's part of a
        pushed state; ``rank=None``: a sharded (DTensor) state with every DTensor leaf assembled
        into its full tensor from all ranks' chunks (ranged reads, each piece verified), or the
        single part of a state that has one. The older form ``load(version, name, rank)`` still works."""
        if isinstance(name, int) and not isinstance(name, bool) and isinstance(step, str):
            warnings.warn("engine.load(version, name) is deprecated; call engine.load(name, step=version)",
                          DeprecationWarning, stacklevel=2)
            name, step = step, name
        if version is not None:
            step = version
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"load: the state's name is required, e.g. engine.load('policy', step=-1); "
                                       f"got {name!r}")
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise InvalidArgumentError(f"load: step must be a step number or -1 (the latest), got {step!r}")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise InvalidArgumentError(f"load: rank must be a non-negative integer or None, got {rank!r}")
        m = self._manifest_at(step)
        entry = m.states.get(name)
        if entry is None:
            raise RestoreError(f"version {m.version} of run {self.run!r} has no state {name!r} "
                               f"(it has: {', '.join(sorted(m.states))})")
        if entry.status != "stored":
            raise RestoreError(f"state {name!r} of version {m.version} is {entry.status}: {entry.detail}")
        if allow_pickle is None:
            reg = self._registry.get(name)
            allow_pickle = bool(reg and reg.allow_pickle)
        if rank is None and entry.shards is not None:  # the full tensors of a sharded state
            try:
                return sharded_io.load_full(tiers_of(self.config), entry, name, bool(allow_pickle))[0]
            except IntegrityError as exc:
                raise RestoreError(f"state {name!r} of version {m.version}: {exc}") from None
        if rank is None:
            if len(entry.files) > 1 and not entry.replicated:
                raise InvalidArgumentError(
                    f"load({name!r}, rank=None): state {name!r} of version {m.version} holds {len(entry.files)} "
                    f"rank-local parts of plain tensors (no DTensors), which cannot be assembled into full "
                    f"tensors; load one rank's part with rank=r")
            rank = 0
        try:
            state, _tier, _ = read_state(tiers_of(self.config), rank_files(entry, name, rank), name, allow_pickle)
        except (IntegrityError, OSError) as exc:
            raise RestoreError(f"state {name!r} of version {m.version}: {one_line(exc)}") from None
        return state

    def load_into(self, name: str, state: Any, step: int = -1, rank: int = 0, *, strict: bool = True,
                  world_size: Optional[int] = None, allow_pickle: Optional[bool] = None) -> StateReport:
        """Fill ``state`` (e.g. ``model.state_dict()`` / ``optim.state_dict()`` of this rank) in
        place from state ``name`` of a committed version; returns a :class:`StateReport` (tier read,
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
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"load_into: the state's name is required, got {name!r}")
        validate_name(name, "state name")
        if not isinstance(step, int) or isinstance(step, bool) or step < -1:
            raise InvalidArgumentError(f"load_into: step must be a step number or -1 (the latest), got {step!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise InvalidArgumentError(f"load_into: rank must be a non-negative integer, got {rank!r}")
        if world_size is None:
            import sys

            dist = getattr(sys.modules.get("torch"), "distributed", None)
            if dist is not None and dist.is_available() and dist.is_initialized():
                world_size = dist.get_world_size()
        m = self._manifest_at(step)
        entry = m.states.get(name)
        if entry is None:
            raise RestoreError(f"version {m.version} of run {self.run!r} has no state {name!r} "
                               f"(it has: {', '.join(sorted(m.states))})")
        if entry.status != "stored":
            raise RestoreError(f"state {name!r} of version {m.version} is {entry.status}: {entry.detail}")
        if allow_pickle is None:
            reg = self._registry.get(name)
            allow_pickle = bool(reg and reg.allow_pickle)
        tiers = tiers_of(self.config)
        if entry.shards is not None:
            return sharded_io.load_into_state(tiers, entry, name, state, strict=strict, allow_pickle=allow_pickle)
        sharded_io.check_world_size(entry, name, m.version, world_size)
        return sharded_io.load_rank_local_into(tiers, entry, name, state, rank, strict=strict,
                                               allow_pickle=allow_pickle)

    def _manifest_at(self, step: int) -> Manifest:
        return self._manifest(-1) if step == -1 else self._manifest(step=step)

    def restore(self, step: int = -1, strict: bool = True, names: Optional[Iterable[str]] = None,
                rewind: bool = False, fallback: bool = False) -> RestoreReport:
        """Bring registered providers back to a committed version (-1: the latest).

        Every file is verified against the manifest before use, read from the local tier first and
        from the remote tier when the local copy is missing or corrupt. With ``strict=True`` nothing
        is loaded into any provider unless every CRITICAL / RELOADABLE state verified.

        ``fallback=True`` (with ``step=-1``): when the newest version fails verification on every
        tier, restore the newest older one that passes; the report's ``skipped_versions`` says
        which were passed over and why. Without it such a restore refuses, loading nothing.

        Versions are steps, so after restoring an older version, saves must go past the newest
        one. ``rewind=True`` instead deletes every version newer than the restored one (after the
        restore succeeded), and training goes on from it with the same step numbers."""
        t0 = time.perf_counter()
        wanted = list(self._registry) if names is None else list(names)
        for n in wanted:
            if n not in self._registry:
                raise InvalidArgumentError(f"state {n!r} is not registered")
        if fallback and step != -1:
            raise InvalidArgumentError("restore(fallback=True) goes back from the latest version; it takes "
                                       f"step=-1, not step={step}")
        candidates = self._call(lambda c: c.manifests.remote(), "the manifests", error=RestoreError) \
            if fallback else [self._manifest_at(step)]
        if not candidates:
            raise RestoreError(f"run {self.run!r} has no committed checkpoint")
        skipped: Dict[int, str] = {}
        for i, m in enumerate(candidates):
            try:
                plan = stages.plan(m, self._registry, wanted)
                staged = stages.stage(plan, self.config)
                reports = stages.verify(staged, self._registry, strict, self.run)
            except RestoreError as exc:
                if not fallback or i == len(candidates) - 1:
                    if skipped:
                        raise RestoreError(f"{exc}; newer versions skipped: "
                                           + "; ".join(f"{v}: {why}" for v, why in skipped.items())) from None
                    raise
                skipped[m.version] = one_line(exc)
                log.warning("restore(fallback=True): version %d does not verify, trying an older one: %s",
                            m.version, one_line(exc))
                continue
            break
        stages.apply(staged, reports, self._registry, self.run)
        # newer versions found in storage but not trusted (unreadable, mis-signed, off the chain)
        untrusted = self._call(lambda c: c.skipped_versions.remote(), "the skipped versions", error=RestoreError)
        skipped.update({v: why for v, why in untrusted.items() if v > m.version and v not in skipped})
        rewound: List[int] = []
        if rewind:
            rewound = self._call(lambda c: c.rewind.remote(m.version), "rewind", 300, RestoreError)
            self._last_saved = m.step
        else:
            self._last_saved = max(self._last_saved, m.step)
        self._step = m.step
        seconds = time.perf_counter() - t0
        metrics_for_run(self.run).restored(seconds)
        return RestoreReport(m.version, m.step, reports, seconds, tuple(rewound), skipped)

    def status(self) -> Dict[str, Any]:
        """Saves in flight with each part's stage, queued bytes per pool, the last error."""
        out = self._call(lambda c: c.status.remote(), "its status").to_dict()
        if self.config.remote_uri and (self._owner or self._saves):
            # this engine counts the saves that take the upload turns: 1 = its next save is uploaded
            every = self.config.remote_every
            out["saves_until_upload"] = 1 if out.get("upload_owed") else every - self._saves % every
        return out


def _start_coordinator(config: EngineConfig) -> Any:
    return CoordinatorActor.options(
        name=actor_name(config.run), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        # max_concurrency: every call is a coroutine on one event loop and none holds a slot while
        # it waits for a commit (submit() only accepts; handles share one wait() per version and
        # process), but thousands of ranks' pushes and waits arrive at once: Ray's default of 1,000
        # slots queued the parts that complete a version behind calls waiting for it (issue 15).
        # A slot costs a coroutine, not a thread, so the ceiling is set far above any world size.
        max_restarts=-1, num_cpus=0, max_concurrency=100_000, **_coordinator_placement(),
    ).remote(config)


def _open_coordinator(config: EngineConfig, timeout: float) -> Tuple[Any, EngineConfig]:
    """Get-or-create the coordinator of ``config.run``, wait until it and its writers answer, and
    return it with the configuration it runs with. Right after a coordinator died, Ray may resolve
    the name to the dead actor for a moment: that is retried (bounded); a coordinator that fails to
    start (its constructor raised) is not."""
    deadline = time.monotonic() + 30
    while True:
        coord = _start_coordinator(config)
        try:
            existing = ray.get(coord.config.remote(), timeout=timeout)
            ray.get(coord.ready.remote(), timeout=timeout)
            return coord, existing
        except ray.exceptions.ActorDiedError as exc:
            if exc.actor_init_failed or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ask(run: str, ref: Any, what: str, timeout: float = 60.0, error: type = CheckpointError) -> Any:
    """``ray.get`` of a coordinator call; Ray's errors become ours, naming the run and the call."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise error(f"the coordinator of run {run!r} did not answer {what} within {timeout:.0f}s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        err = error(f"the coordinator of run {run!r} is not reachable ({what}): {one_line(exc)[:200]}; "
                    f"a restarted coordinator answers again once Ray has recreated it")
        err.actor_died = isinstance(exc, ray.exceptions.ActorDiedError)  # for CheckpointEngine._call
        raise err from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise error(f"{what} failed in the coordinator of run {run!r}: {one_line(cause or exc)[:300]}") from None


def _check_metrics(metrics: Optional[Dict[str, float]]) -> Dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise InvalidSaveError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InvalidSaveError(f"metrics must map str -> finite number; bad entry {k!r}: {v!r}")
        out[k] = float(v)
    return out
