"""Tune: one run per trial, Tune checkpoints that name a version (so PBT can clone a trial), and
the Algorithm's end (``algorithm.stop()``).

**One run per trial.** Inside a Tune trial the callback's run is ``<run>-<trial_id>`` (Tune's
trial id, e.g. ``ppo-cartpole-3f2a1_00001``; :func:`trial_run_name`), so concurrent trials never
share versions, and a trial that Tune restarts (``FailureConfig(max_failures=...)``) keeps its id
and finds its own run again. Outside Tune the run name is used as given. ``per_trial=False`` keeps
one run for every trial (then at most one trial may run at a time).

**Tune checkpoints name a version.** With ``tune_checkpoints="pointer"`` (default) the callback
replaces the Algorithm's ``save_checkpoint`` / ``load_checkpoint`` (what ``Trainable.save()`` /
``restore()`` call -- Tune's checkpointing, PBT's exploit): a Tune checkpoint is one small JSON
file (:data:`POINTER_FILE`: run, version, iteration) naming a committed ray_ckpt version of the
trial's current state (saved then if the current iteration has none, and waited for), and
restoring it runs :func:`restore_algorithm` on that version. PBT cloning trial B into trial A
hands A the checkpoint of B: A reads B's version straight from storage (:class:`StoredRun`, no
coordinator of B needed: B may be paused, its coordinator stopped), then saves into its own run.
A directory without that file (an RLlib checkpoint) is loaded by RLlib as before. RLlib's own
``save_to_path`` / ``from_checkpoint`` are not changed. ``tune_checkpoints="rllib"`` leaves
``save_checkpoint`` / ``load_checkpoint`` alone (Tune checkpoints are RLlib's, full size).

**A clone trains with its own hyperparameters.** PBT's exploit restores the source trial's
version into a trial whose config it mutated (``lr`` 1e-3 -> 5e-4). The restored optimizer state
carries the source's ``param_groups`` (its learning rate); RLlib would put the trial's own lr back
only after the first update, so the clone's first iteration trained with the source's lr. When the
version comes from another run, the optimizers' ``param_groups`` settings the clone's learners were
built with (its config: lr, and what its learner sets from the config) are put back over the
restored state, and each optimizer's lr Scheduler (a fixed ``lr`` or a schedule) sets its lr at the
restored ``num_env_steps_sampled_lifetime``, as RLlib's ``after_gradient_based_update`` does
(:func:`apply_trial_optimizer_settings`). A trial restored from its own version keeps the state as
saved.

**The end.** ``algorithm.stop()`` (Tune stops a trial's Algorithm the same way) first waits, at
most ``stop_timeout_s``, for the callback's saves in flight, then shuts down the coordinator the
callback started -- one it created, or its trial's own run -- but not one that existed before under
the run name as given (a user's ``CheckpointEngine.create``, which the user shuts down).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
import warnings
from typing import Any, Dict, List, Optional

import ray

from ...coordinator.catalogue import meta_of
from ...storage.checkpoint_io import rank_files, read_manifest
from ...config import EngineConfig
from ...protocol import NAMESPACE, actor_name
from ...errors import CheckpointError, IntegrityError, InvalidArgumentError, RestoreError, one_line
from ...capture.restored import read_state_reported, tiers_of
from ...storage.layout import validate_name
from ...types import CheckpointMeta
from .base._rllib_internals import scheduled_lr, set_optimizer_lr
from .base.learner_params import registered_optimizers
from .base.names import log

POINTER_FILE = "ray_ckpt_version.json"
POINTER_FORMAT = "ray_ckpt.rllib.version-pointer/1"
_NO_TRIAL = "default"  # what Trainable.trial_id returns outside Tune (and, from RLlib, inside)
_WORKING_DIRS = "working_dirs"  # Tune's parent directory of the trials' working directories
_TRIAL_ID_IN_DIRNAME = re.compile(r"_([0-9a-f]{5}_[0-9]{5})(?=_|$)")  # "PPO_CartPole-v1_3f2a1_00001_0_lr=..."
_HOOKED = "_ray_ckpt_hooked_by"


# ====================================================================== one run per trial
def tune_trial_id(algorithm: Any) -> Optional[str]:
    """The id of the Tune trial ``algorithm`` runs in (e.g. ``3f2a1_00001``), or None outside Tune.

    RLlib drops the trial info Tune hands a Trainable (``AlgorithmConfig.update_from_dict`` skips
    it), so an Algorithm's ``trial_id`` is "default" under Tune too. What a trial's Algorithm does
    have is its working directory, ``Trainable.logdir``: Tune's ``<experiment>/working_dirs/
    <trial_dir_name>`` (``StorageContext.trial_working_directory``), whose default name starts with
    the trial name ``<trainable>_<trial_id>``; it is the same for every restart of the trial. A
    ``trial_dirname_creator`` that leaves the id out gives a digest of the directory name instead.
    Other Trainables (the Algorithm built in a function trainable) use ``trial_id`` / Tune's
    session."""
    tid = getattr(algorithm, "trial_id", None)
    if isinstance(tid, str) and tid and tid != _NO_TRIAL:
        return tid
    logdir = getattr(algorithm, "logdir", None)
    if isinstance(logdir, str) and os.path.basename(os.path.dirname(logdir.rstrip("/"))) == _WORKING_DIRS:
        name = os.path.basename(logdir.rstrip("/"))
        m = _TRIAL_ID_IN_DIRNAME.search(name)
        return m.group(1) if m else "t" + hashlib.sha256(name.encode()).hexdigest()[:12]
    try:
        from ray import tune
        with warnings.catch_warnings():  # outside a session it warns and returns None
            warnings.simplefilter("ignore")
            tid = tune.get_context().get_trial_id()
    except Exception:  # pragma: no cover - Tune not importable / no context
        return None
    return tid if isinstance(tid, str) and tid else None


def coordinator_exists(run: str) -> bool:
    """Whether run ``run`` has a live coordinator now (before ``create()`` gets or creates it)."""
    try:
        ray.get_actor(actor_name(run), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def trial_run_name(run: str, trial_id: str) -> str:
    """``<run>-<trial_id>``: a trial's own run (a valid run name, else InvalidArgumentError)."""
    name = f"{run}-{trial_id}"
    try:
        return validate_name(name, "run name")
    except ValueError as exc:
        raise InvalidArgumentError(f"the run of Tune trial {trial_id!r} would be {name!r}, which is not a valid "
                                   f"run name ({exc}); shorten the run name or pass per_trial=False") from None


# ====================================================================== Tune checkpoints: a pointer file
def write_pointer(directory: str, run: str, version: int, iteration: int) -> str:
    path = os.path.join(directory, POINTER_FILE)
    with open(path, "w") as f:
        json.dump({"format": POINTER_FORMAT, "run": run, "version": int(version), "iteration": int(iteration)}, f)
    return path


def read_pointer(checkpoint: Any) -> Optional[Dict[str, Any]]:
    """The pointer of a Tune checkpoint directory; None where it holds none (an RLlib checkpoint).
    A pointer file that is not one raises RestoreError naming it."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return None
    path = os.path.join(os.fspath(checkpoint), POINTER_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            p = json.load(f)
        if p.get("format") != POINTER_FORMAT:
            raise ValueError(f"format {p.get('format')!r}, expected {POINTER_FORMAT!r}")
        validate_name(p["run"], "run name")
        for key in ("version", "iteration"):
            if not isinstance(p[key], int) or isinstance(p[key], bool) or p[key] < 0:
                raise ValueError(f"{key} {p[key]!r} is not a version number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RestoreError(f"{path}: not a ray_ckpt version pointer ({one_line(exc)[:200]})") from None
    return p


class StoredRun:
    """Another run's committed versions read straight from its tiers, without its coordinator (which
    may be stopped: a paused or finished trial). What :func:`restore_algorithm` needs of an engine:
    ``run``, ``config``, ``list_checkpoints()`` and ``load(name, version=..., allow_pickle=...)``.
    Reads are verified as an engine's are (checksums, signatures with ``signing_key``), local tier
    first, then the remote one."""

    def __init__(self, config: EngineConfig, versions: Optional[List[int]] = None):
        self.config = config
        self.run = config.run
        self._tiers = tiers_of(config)
        self._versions = versions
        self._manifests: Dict[int, Any] = {}

    def manifest(self, version: int) -> Any:
        if version not in self._manifests:
            problems = []
            for tier in self._tiers:
                if not hasattr(tier, "version_dirs"):  # peer replicas hold files, not manifests
                    continue
                try:
                    self._manifests[version] = read_manifest(tier, version, self.config.signing_key)
                    break
                except FileNotFoundError:
                    problems.append(f"{tier.name}: no manifest")
                except (IntegrityError, OSError) as exc:
                    problems.append(f"{tier.name}: {one_line(exc)[:200]}")
            else:
                raise RestoreError(f"run {self.run!r} has no committed version {version} in storage "
                                   f"({'; '.join(problems)}); was it deleted by retention (keep_last)?")
        return self._manifests[version]

    def list_checkpoints(self) -> List[CheckpointMeta]:
        if self._versions is None:
            raise InvalidArgumentError("StoredRun lists only the versions it was opened with")
        stored = tuple(t.name for t in self._tiers if hasattr(t, "version_dirs"))  # not the peer replicas
        return [meta_of(self.manifest(v), stored) for v in self._versions]

    def load(self, name: str, step: int = -1, rank: Optional[int] = 0, *, version: Optional[int] = None,
             allow_pickle: Optional[bool] = None, with_report: bool = False) -> Any:
        """``CheckpointEngine.load`` of the stored run (``with_report``: ``(state, StateReport)``)."""
        v = step if version is None else version
        if v is None or v < 0:
            raise InvalidArgumentError("StoredRun.load needs a version number")
        m = self.manifest(v)
        entry = m.states.get(name)
        if entry is None or entry.status != "stored":
            why = "no such state" if entry is None else f"{entry.status}: {entry.detail}"
            raise RestoreError(f"state {name!r} of version {v} of run {self.run!r}: {why}")
        files = rank_files(entry, name, rank or 0)
        try:
            state, report = read_state_reported(self._tiers, files, name, bool(allow_pickle))
        except (IntegrityError, OSError) as exc:
            raise RestoreError(f"state {name!r} of version {v} of run {self.run!r}: {one_line(exc)}") from None
        return (state, report) if with_report else state


# ====================================================================== the Algorithm's methods
def install_hooks(algorithm: Any, callback: Any) -> None:  # callback: a RayCkptCallback (it imports this module)
    """Wrap the Algorithm's ``cleanup`` (what ``stop()`` calls) and, with
    ``tune_checkpoints="pointer"``, replace its ``save_checkpoint`` / ``load_checkpoint`` (what
    ``Trainable.save()`` / ``restore()`` call). On this instance only; once."""
    if getattr(algorithm, _HOOKED, None) is callback:
        return
    setattr(algorithm, _HOOKED, callback)
    cleanup = algorithm.cleanup

    def stop_then_cleanup() -> None:
        try:
            callback.close(callback.settings.stop_timeout_s)
        except Exception as exc:  # stop() must go on to stop the learners and env runners
            log.error("ray_ckpt: closing run %r at algorithm.stop(): %s", callback.run, one_line(exc))
        finally:
            cleanup()

    algorithm.cleanup = stop_then_cleanup
    if callback.settings.tune_checkpoints != "pointer":
        return
    rllib_load = algorithm.load_checkpoint

    def save_checkpoint(checkpoint_dir: str) -> None:
        t0 = time.monotonic()
        version = callback.checkpoint_version(algorithm, callback.settings.stop_timeout_s)
        write_pointer(checkpoint_dir, callback.run, version, int(algorithm.iteration))
        log.info("ray_ckpt: Tune checkpoint of iteration %d -> version %d of run %r (%.2fs)",
                 algorithm.iteration, version, callback.run, time.monotonic() - t0)

    def load_checkpoint(checkpoint: Any) -> None:
        pointer = read_pointer(checkpoint)
        if pointer is None:
            return rllib_load(checkpoint)
        own = trial_optimizer_settings(algorithm) if pointer["run"] != callback.run else None
        callback.restore_pointer(algorithm, pointer)
        if own is not None:  # a clone (PBT's exploit): its own hyperparameters over the source's optimizer state
            apply_trial_optimizer_settings(algorithm, own)
        _checkpoint_loaded(algorithm)

    algorithm.save_checkpoint = save_checkpoint
    algorithm.load_checkpoint = load_checkpoint


def _checkpoint_loaded(algorithm: Any) -> None:
    """RLlib's ``on_checkpoint_loaded`` callbacks, as ``Algorithm.load_checkpoint`` calls them."""
    cbs = algorithm.callbacks
    for cb in cbs if isinstance(cbs, (list, tuple)) else [cbs]:
        if cb is not None and hasattr(cb, "on_checkpoint_loaded"):
            cb.on_checkpoint_loaded(algorithm=algorithm)
    for fn in getattr(algorithm.config, "callbacks_on_checkpoint_loaded", None) or ():
        fn(algorithm=algorithm)


def open_run(run: str, version: int, config: EngineConfig) -> StoredRun:
    """Run ``run`` next to the one of ``config`` (same tiers and options), read from storage."""
    try:
        other = dataclasses.replace(config, run=run)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot open run {run!r} next to run {config.run!r}: {exc}") from None
    return StoredRun(other, [version])


# ====================================================================== a clone's own hyperparameters
def _group_settings(learner: Any) -> Dict[str, List[Dict[str, Any]]]:
    """Runs in each learner: every optimizer's ``param_groups`` settings (all but ``params``)."""
    import copy

    return {f"{mid}/{name}": [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                              for g in opt.param_groups] for mid, name, opt in registered_optimizers(learner)}


def _apply_group_settings(learner: Any, settings: Dict[str, List[Dict[str, Any]]], timestep: int) -> None:
    """Runs in each learner: ``settings`` over its optimizers' param groups, then each scheduled lr."""
    for mid, name, opt in registered_optimizers(learner):
        for group, own in zip(opt.param_groups, settings.get(f"{mid}/{name}", ())):
            group.update(own)
        lr = scheduled_lr(learner, opt, timestep)
        if lr is not None:
            set_optimizer_lr(learner, opt, lr)


def _each_learner(algorithm: Any, fn: Any, **kwargs: Any) -> List[Any]:
    results = []
    for r in algorithm.learner_group.foreach_learner(fn, **kwargs):
        if not r.ok:
            raise RestoreError(f"applying the trial's optimizer settings in a learner failed: {one_line(r.get())}")
        results.append(r.get())
    return results


def trial_optimizer_settings(algorithm: Any) -> Dict[str, List[Dict[str, Any]]]:
    """The ``param_groups`` settings of the algorithm's optimizers before a restore: what its
    learners were built with from the trial's config (every learner is built from the same one)."""
    return _each_learner(algorithm, _group_settings)[0]


def apply_trial_optimizer_settings(algorithm: Any, settings: Dict[str, List[Dict[str, Any]]]) -> None:
    """``settings`` (:func:`trial_optimizer_settings`) over the restored optimizer state of every
    learner, then each optimizer's lr from its Scheduler at the restored sampled-steps count."""
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

    timestep = int(algorithm.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0) or 0)
    _each_learner(algorithm, _apply_group_settings, settings=settings, timestep=timestep)
