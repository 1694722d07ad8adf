"""Saving: the RLlib callback that checkpoints an Algorithm every N iterations without blocking
``train()`` (and, with ``resume=True``, restores the latest version when the Algorithm is built).

Why ``train()`` is not blocked: the callback runs in the algorithm's process right after the
iteration. It reads the local learner's state (numpy views of the torch parameters, no copy), the
connector states (small) and the RNG states, and calls ``engine.save(iteration)``, which flattens
them (no copy) and ``ray.put`` s them: one memcpy of the state, the floor. Serialising,
checksumming, writing and uploading happen in the engine's writer actors. A remote env runner's
state is snapshotted *inside that runner* (the callback installs a ``ckpt_get_state`` on the actor
and registers the actor handle; the engine submits the snapshot, whose ObjectRef goes straight to
a writer), so no remote call is awaited either. If ``max_in_flight`` saves are still in flight,
``on_busy="skip"`` (default) skips that iteration's save instead of waiting (counted and logged).
With remote learners (``num_learners >= 1``) the learner states (``policy``, ``optimizer``, the
learner half of ``metrics``) are snapshotted the same way, *inside the first learner actor*
(:mod:`.learners`: under DDP all learners hold the same state), so ``train()`` waits for no
learner transfer either; a restore pushes them into every learner and checks each one's answer.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Tuple

from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

from ...client.engine import CheckpointEngine, SaveHandle
from ...capture.gc_pause import collections_paused
from ...errors import InvalidArgumentError, SaveError
from ...types import SaveResult, Strategy
from .capture import OVERLAPPED, capture_algorithm_state
from .env_runners import runner_snapshot_actors
from .learners import LearnerCapture
from .base.names import CONNECTORS, COUNTERS, METRICS, OPTIMIZER, POLICY, RNG, log
from .replay.algorithm import prepare_replay, replay_strategy, sync_replay_registrations
from .restore import AlgorithmRestoreReport, restore_algorithm
from .settings import CheckpointSettings
from .tune import coordinator_exists, install_hooks, open_run, trial_run_name, tune_trial_id


class RayCkptCallback(RLlibCallback):
    """Saves the algorithm every ``settings.every`` iterations from ``on_train_result``.

    Construct it with the settings (``RayCkptCallback("run", local_dir=..., every=5)``, e.g. through
    ``functools.partial``) or use :func:`make_callback`, which binds them to a subclass. After each
    iteration ``result["ray_ckpt"]`` holds a summary (saves, skipped, failed, last save() call ms, the
    version resumed from or -1, the run).
    Attributes for inspection: ``run`` (the run saved into: ``<run>-<trial_id>`` in a Tune trial, see
    :mod:`.tune`), ``engine``, ``saves`` (version -> SaveHandle; one that ended holds no snapshots:
    ``SaveHandle.release_snapshots``), ``save_call_ms``, ``skipped``, ``failures``, ``resumed`` (the
    AlgorithmRestoreReport of a ``resume``, else None), ``loaded`` (that of the last Tune checkpoint
    restored, else None).

    A version's number is the iteration it holds, except after the algorithm was set back to an
    older state (``restore_algorithm`` of an older version, a Tune checkpoint restored, a PBT
    exploit): a run's versions only grow, so such a save takes the run's last version + 1 (its
    counters, and ``AlgorithmRestoreReport.iteration``, still say the iteration) -- and a resume
    brings back the newest state, not the one training went back from."""

    settings: Optional[CheckpointSettings] = None  # bound by make_callback

    def __init__(self, run: Optional[str] = None, local_dir: Optional[str] = None,
                 remote_uri: Optional[str] = None, **options: Any):
        super().__init__()
        if run is not None:
            self.settings = CheckpointSettings(run, local_dir, remote_uri, **options)
        elif options or local_dir is not None or remote_uri is not None:
            raise InvalidArgumentError("RayCkptCallback: pass the run name as the first argument")
        elif type(self).settings is None:
            raise InvalidArgumentError("RayCkptCallback needs settings: RayCkptCallback('run', local_dir=...) "
                                       "through functools.partial, or make_callback('run', local_dir=...)")
        self.engine: Optional[CheckpointEngine] = None
        self.saves: Dict[int, SaveHandle] = {}
        self.save_call_ms: List[float] = []
        self.skipped: List[int] = []
        self.failures: Dict[int, str] = {}
        self.results: Dict[int, SaveResult] = {}
        self.resumed: Optional[AlgorithmRestoreReport] = None
        self._pending: Dict[str, Any] = {}
        self._open: List[int] = []
        self._runner_names: set = set()
        self._learners = LearnerCapture()  # remote learners: states captured in the first learner (learners.py)
        self._last_step = -1  # the newest step the run has used (save() saves above it)
        self._newest_listed = -1  # the newest version listed when the engine was connected (resume)
        self.run: str = self.settings.run
        self.loaded: Optional[AlgorithmRestoreReport] = None
        self._restored_from = ""  # "<run>@<version>" of the last Tune checkpoint restored
        self._owns_coordinator = False  # shut it down at algorithm.stop() (tune.py says which)
        self._last_saved_at: Optional[Tuple[int, int]] = None  # (iteration, version) of the current state's save

    # ------------------------------------------------------------------ RLlib hooks
    def on_algorithm_init(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        if self.engine is None:
            self.run = self._run_for(algorithm)
        eng = self._ensure_engine()
        install_hooks(algorithm, self)
        s = self.settings
        if s.replay_strategy != "off":
            prepare_replay(algorithm)
        if s.resume and self._newest_listed >= 0:
            self.resumed = restore_algorithm(algorithm, eng, timeout_s=s.resume_timeout_s, restore_rng=s.rng,
                                             allow_pickle=s.allow_pickle)
            self._last_saved_at = (self.resumed.iteration, self.resumed.version)
            log.info("ray_ckpt: run %r resumed from version %d (iteration %d)", self.run, self.resumed.version,
                     self.resumed.iteration)

    def on_train_result(self, *, algorithm: Any, metrics_logger: Any = None, result: dict,
                        **kwargs: Any) -> None:
        self._collect(block=False)
        it = int(algorithm.iteration)
        due = it % self.settings.every == 0
        # a preemption notice (a drained node of the run): one more save now, whatever the cadence
        last = self.engine.preemption_save_due() if self.engine is not None else None
        if due or last is not None:
            self.save(algorithm, it, result=result, on_busy=None if due else "queue")
        if isinstance(result, dict):
            result["ray_ckpt"] = self.summary()

    # ------------------------------------------------------------------ API
    def save(self, algorithm: Any, iteration: Optional[int] = None, result: Optional[dict] = None,
             on_busy: Optional[str] = None) -> SaveHandle:
        """Capture the algorithm now and hand it to the engine (returns at once). The version is the
        iteration, or the run's last version + 1 where that is not above it (see the class)."""
        t0 = time.perf_counter()
        eng = self._ensure_engine()
        it = int(algorithm.iteration) if iteration is None else int(iteration)
        s = self.settings
        step = it
        if it <= self._last_step:
            # the algorithm was set back to an older state: versions are steps and only grow
            step = self._last_step + 1
            log.info("ray_ckpt: iteration %d is saved as version %d of run %r, which has used steps up to %d "
                     "(the algorithm was set back to an older state, or resumed from the version before a lost "
                     "one)", it, step, self.run, self._last_step)
        errors: Dict[str, str] = {}
        with collections_paused():  # the capture's short-lived containers never reach a full collection
            self._pending = capture_algorithm_state(algorithm, rng=s.rng, metrics=s.metrics,
                                                    allow_pickle=s.allow_pickle, errors=errors,
                                                    replay=replay_strategy(s.replay_strategy, algorithm), engine=eng)
        for name, why in errors.items():
            log.warning("ray_ckpt: iteration %d: best-effort state %r not saved: %s", it, name, why)
        try:
            self._sync_registrations(eng, algorithm)
            # pauses the collector around its own capture, not around a wait for room (on_busy="wait")
            handle = eng.save(step, on_busy=on_busy or s.on_busy, metrics=_save_metrics(result))
        finally:
            self._pending = {}
        ms = (time.perf_counter() - t0) * 1e3
        self.save_call_ms.append(ms)
        if handle.skipped:
            self.skipped.append(it)
            log.warning("ray_ckpt: iteration %d not saved: %d saves of run %r still in flight "
                        "(on_busy='skip')", it, len(self._open), self.run)
        else:
            self.saves[step] = handle
            self._open.append(step)
            self._last_step = step
            self._last_saved_at = (it, step)
        return handle

    def flush(self, timeout: Optional[float] = None) -> Dict[int, SaveResult]:
        """Wait until every save of this callback is committed locally; raises SaveError on a failure
        (whatever ``on_error`` says). Returns {version: SaveResult} of all saves so far."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for it in list(self._open):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.results[it] = self.saves[it].wait(left)
            except SaveError as exc:
                self.failures[it] = str(exc)
            self._open.remove(it)
            self.saves[it].release_snapshots()
        if self.failures:
            raise SaveError("; ".join(f"step {i}: {m}" for i, m in sorted(self.failures.items())))
        return dict(self.results)

    def checkpoint_version(self, algorithm: Any, timeout: Optional[float] = None) -> int:
        """The version that holds the algorithm's current state, committed (what a Tune checkpoint
        points at): this iteration's save, or one taken now (``on_busy="wait"``); waits at most
        ``timeout`` for it and raises SaveError if it fails or is not committed by then."""
        it = int(algorithm.iteration)
        if self._last_saved_at is None or self._last_saved_at[0] != it:
            self.save(algorithm, it, on_busy="wait")
        if self._last_saved_at is None or self._last_saved_at[0] != it:
            raise SaveError(f"ray_ckpt: iteration {it} of run {self.run!r} could not be saved for a checkpoint")
        version = self._last_saved_at[1]
        handle = self.saves.get(version)
        if handle is not None:  # else: restored from this run's version, which is committed
            try:
                self.results[version] = handle.wait(timeout)
            except SaveError as exc:
                raise SaveError(f"ray_ckpt: the checkpoint of iteration {it} is version {version} of run "
                                f"{self.run!r}, which is not committed: {exc}") from None
        return version

    def restore_pointer(self, algorithm: Any, pointer: Dict[str, Any]) -> AlgorithmRestoreReport:
        """Restore the version a Tune checkpoint names (:mod:`.tune`): of this run through its engine,
        of another run (PBT: the trial being cloned) straight from storage."""
        s = self.settings
        eng = self._ensure_engine()
        run, version = pointer["run"], pointer["version"]
        source = eng if run == self.run else open_run(run, version, eng.config)
        self.loaded = restore_algorithm(algorithm, source, version, timeout_s=s.resume_timeout_s,
                                        restore_rng=s.rng, allow_pickle=s.allow_pickle)
        self._last_saved_at = (self.loaded.iteration, version) if source is eng else None
        self._restored_from = f"{run}@{version}"
        log.info("ray_ckpt: run %r: restored version %d of run %r (iteration %d) from a Tune checkpoint",
                 self.run, version, run, self.loaded.iteration)
        return self.loaded

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait (at most ``timeout``, default ``stop_timeout_s``) for the saves in flight, then shut
        down the coordinator this callback started, or detach from one it did not (see :mod:`.tune`).
        ``algorithm.stop()`` calls it; a later save starts the engine again."""
        eng = self.engine
        if eng is None:
            return
        timeout = self.settings.stop_timeout_s if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
        except SaveError as exc:
            log.error("ray_ckpt: run %r: saves not committed at algorithm.stop(): %s", self.run, exc)
        self.engine = None
        eng.shutdown(timeout=max(1.0, deadline - time.monotonic()), stop_coordinator=self._owns_coordinator)
        log.info("ray_ckpt: run %r closed (%s)", self.run,
                 "coordinator stopped" if self._owns_coordinator else "detached from the coordinator")

    def summary(self) -> Dict[str, Any]:
        return {"saves": len(self.saves), "in_flight": len(self._open), "skipped": len(self.skipped),
                "failed": len(self.failures),
                "last_saved_iteration": self._last_saved_at[0] if self.saves and self._last_saved_at else -1,
                "last_saved_version": max(self.saves) if self.saves else -1, "run": self.run,
                "last_save_call_ms": self.save_call_ms[-1] if self.save_call_ms else float("nan"),
                "resumed_version": self.resumed.version if self.resumed is not None else -1,
                "restored_from": self._restored_from}

    # ------------------------------------------------------------------ internals
    def _run_for(self, algorithm: Any) -> str:
        """The run this callback saves into: ``<run>-<trial_id>`` in a Tune trial (``per_trial``)."""
        s = self.settings
        trial = tune_trial_id(algorithm) if s.per_trial else None
        if trial is None:
            return s.run
        if s.local_dir is None:
            raise InvalidArgumentError(
                f"ray_ckpt: in Tune trial {trial!r} the callback saves into the trial's own run "
                f"{trial_run_name(s.run, trial)!r}, which it creates: pass local_dir= (and remote_uri=) to "
                f"make_callback, or per_trial=False to save every trial into run {s.run!r}")
        return trial_run_name(s.run, trial)

    def _ensure_engine(self) -> CheckpointEngine:
        if self.engine is None:
            existed = coordinator_exists(self.run)
            self.engine = self.settings.engine(self.run)
            # stopped at algorithm.stop(): a coordinator this callback started, or its trial's own run
            # (started by an earlier incarnation of the trial); never the user's run as given
            self._owns_coordinator = self.settings.local_dir is not None and (
                not existed or self.run != self.settings.run)
            self._newest_listed = max((m.version for m in self.engine.list_checkpoints()), default=-1)
            # a version lost with its node is no longer listed but its step is never used again: the
            # iteration a resumed algorithm redoes is saved after it (see save())
            self._last_step = max(self._newest_listed, self.engine.last_saved_step)
            self._register_static(self.engine)
        return self.engine

    def _register_static(self, eng: CheckpointEngine) -> None:
        s = self.settings
        names = [(n, Strategy.CRITICAL) for n in (POLICY, OPTIMIZER, CONNECTORS, COUNTERS)]
        if s.rng:
            names.append((RNG, Strategy.CRITICAL))
        if s.metrics:
            names.append((METRICS, Strategy.BEST_EFFORT))
        for name, strat in names:
            self._register(eng, name, strat)

    def _register(self, eng: CheckpointEngine, name: str, strategy: Strategy) -> None:
        """Register ``name`` to be read from this save's captured states."""
        def get() -> Any:
            try:
                return self._pending[name]
            except KeyError:
                raise SaveError(f"RLlib state {name!r} was not captured for this save") from None
        get.__name__ = f"rllib_{name}"
        eng.register(name, get, strategy=strategy, allow_pickle=name in self.settings.allow_pickle, replace=True,
                     overlap=name in OVERLAPPED)

    def _sync_registrations(self, eng: CheckpointEngine, algorithm: Any) -> None:
        s = self.settings
        if s.metrics:
            if METRICS in self._pending and METRICS not in eng.registered:
                self._register(eng, METRICS, Strategy.BEST_EFFORT)
            elif METRICS not in self._pending and METRICS in eng.registered:
                eng.unregister(METRICS)
        self._learners.sync(eng, algorithm, self._pending, s.allow_pickle)  # no-op with a local learner
        sync_replay_registrations(eng, algorithm, s.replay_strategy, self._pending, lambda: self._pending)
        if not s.env_runner_states:
            return
        actors = runner_snapshot_actors(algorithm)
        for name, h in actors.items():
            eng.register(name, h, strategy=Strategy.BEST_EFFORT, replace=True)
        for name in self._runner_names - set(actors):
            if name in eng.registered:
                eng.unregister(name)
        self._runner_names = set(actors)

    def _collect(self, block: bool) -> None:
        for it in list(self._open):
            h = self.saves[it]
            if not block and not h.done():
                continue
            self._open.remove(it)
            h.release_snapshots()  # kept in self.saves: without its snapshots (one set per version otherwise)
            try:
                self.results[it] = h.wait(None if block else 0)
            except SaveError as exc:
                self.failures[it] = str(exc)
                if self.settings.on_error == "raise":
                    raise SaveError(f"ray_ckpt: the save of version {it} (run {self.run!r}) "
                                    f"failed: {exc}") from None
                log.error("ray_ckpt: the save of version %d (run %r) failed: %s", it, self.run, exc)


def _save_metrics(result: Optional[dict]) -> Optional[Dict[str, float]]:
    if not isinstance(result, dict):
        return None
    env = result.get(ENV_RUNNER_RESULTS)
    v = env.get("episode_return_mean") if isinstance(env, dict) else None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return {"episode_return_mean": v} if math.isfinite(v) else None


def make_callback(run: str, local_dir: Optional[str] = None, remote_uri: Optional[str] = None,
                  **options: Any) -> type:
    """A :class:`RayCkptCallback` subclass with these settings bound, for ``config.callbacks(...)``.

    Options: see :class:`CheckpointSettings` (every, keep_last, keep_every, on_busy, on_error,
    env_runner_states, rng, metrics, allow_pickle, engine_options, resume, resume_timeout_s,
    replay_strategy). The
    settings are validated here."""
    settings = CheckpointSettings(run, local_dir, remote_uri, **options)
    return type(f"RayCkptCallback_{run.replace('-', '_').replace('.', '_')}", (RayCkptCallback,),
                {"settings": settings, "__module__": __name__})


def find_callback(algorithm: Any) -> Optional[RayCkptCallback]:
    """The RayCkptCallback instance of an Algorithm (None if it has none)."""
    cbs = algorithm.callbacks
    for cb in cbs if isinstance(cbs, (list, tuple)) else [cbs]:
        if isinstance(cb, RayCkptCallback):
            return cb
    return None


def wait_for_saves(algorithm: Any, timeout: Optional[float] = None) -> Dict[int, SaveResult]:
    """Wait for every save of the algorithm's RayCkptCallback (e.g. before ``algorithm.stop()``)."""
    cb = find_callback(algorithm)
    if cb is None:
        raise InvalidArgumentError("this algorithm has no RayCkptCallback (config.callbacks(make_callback(...)))")
    return cb.flush(timeout)
