"""Restoring an Algorithm from a version: :func:`restore_algorithm` (storable state -> RLlib state).

It reads every state of one version (verified, local tier first, remote tier as fallback) *before*
touching the algorithm, sets the learner (weights, optimizer, a new ``weights_seq_no``), the
connectors, counters, metrics and RNGs, then pushes weights + connector states to every remote env
runner with a synchronous call bounded by ``timeout_s`` and verifies each runner's answer (a digest
of its module weights, its connector state): see :mod:`.env_runners` for why RLlib's own sync after
``restore_from_path`` is not enough. The restored weights are stamped with a ``weights_seq_no`` above
both the checkpoint's and the learner's current one, so no runner ignores them and later syncs from
the learner keep applying.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple, Union

from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_METRICS_LOGGER, COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, WEIGHTS_SEQ_NO

from ...client.engine import CheckpointEngine
from ...errors import CheckpointError, RestoreError
from ...capture.rng import set_rng_state
from .base._rllib_internals import load_learner_state
from .capture import algorithm_connectors
from .base.conversion import from_storable
from .env_runners import RunnerSync, push_to_env_runners, saved_runner_states
from .learners import is_remote, restore_remote_learners
from .base.names import (CONNECTORS, COUNTERS, CRITICAL_STATES, ENV_RUNNER_PREFIX, METRICS, OPTIMIZER, POLICY,
                    REPLAY_JOURNAL, RNG, TRAINING_ITERATION)
from .replay.algorithm import restore_algorithm_replay


@dataclass
class AlgorithmRestoreReport:
    """What :func:`restore_algorithm` did. ``states``: name -> "restored (local)" / "missing: why" /
    "not restored: why"; ``env_runners``: remote runner id -> "verified" (weights digest + connector
    state confirmed by the runner) or the problem; ``seconds``: the whole restore incl. the sync;
    ``learners``: remote learner id -> "verified" (weights + optimizer digests confirmed by each
    learner; empty with a local learner)."""

    version: int
    iteration: int
    weights_seq_no: int
    states: Dict[str, str]
    env_runners: Dict[int, str]
    weights_digest: str
    seconds: float
    sync_seconds: float
    learners: Dict[int, str] = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return all(v == "verified" for v in self.env_runners.values())


# ====================================================================== step 1: which version, read it all
def _resolve_engine(run: Union[str, CheckpointEngine], local_dir: Optional[str], remote_uri: Optional[str],
                    engine_options: Optional[Dict[str, Any]]) -> CheckpointEngine:
    if isinstance(run, CheckpointEngine) or hasattr(run, "list_checkpoints"):
        return run  # an engine, or an engine-like reader (tune.StoredRun: another run read from storage)
    if local_dir is not None:
        return CheckpointEngine.create(run, local_dir=local_dir, remote_uri=remote_uri, **(engine_options or {}))
    return CheckpointEngine.connect(run)


def _pick_version(engine: CheckpointEngine, version: int):
    metas = sorted(engine.list_checkpoints(), key=lambda m: m.version)
    if not metas:
        raise RestoreError(f"run {engine.run!r} has no committed checkpoint")
    if version == -1:
        return metas[-1]
    for m in metas:
        if m.version == version:
            return m
    raise RestoreError(f"run {engine.run!r} has no committed version {version} "
                       f"(it has: {', '.join(str(m.version) for m in metas)})")


def _load_states(engine: CheckpointEngine, meta: Any, restore_env_runners: bool,
                 pickled: set) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """(loaded: name -> stored state, states: name -> what became of it) for our states of ``meta``."""
    v = meta.version
    states: Dict[str, str] = {}
    loaded: Dict[str, Any] = {}
    known = set(CRITICAL_STATES) | {METRICS, REPLAY_JOURNAL}  # not replay + replay_meta: refused, not read
    for name in meta.states:
        if name.startswith(ENV_RUNNER_PREFIX):
            if not restore_env_runners:
                states[name] = "not restored: restore_env_runners=False"
                continue
        elif name not in known:
            continue  # not one of ours
        try:
            loaded[name], report = engine.load(name=name, version=v, allow_pickle=name in pickled, with_report=True)
            states[name] = f"restored ({report.source})"
        except (RestoreError, CheckpointError) as exc:
            states[name] = f"missing: {exc}"
    for name in (POLICY, OPTIMIZER, CONNECTORS, COUNTERS):
        if name not in loaded:
            states.setdefault(name, f"missing: version {v} has no state {name!r}")
    return loaded, states


def _require_critical(engine: CheckpointEngine, meta: Any, loaded: Dict[str, Any], states: Dict[str, str],
                      strict: bool) -> None:
    """With ``strict``, raise (before anything is changed) if a critical state could not be read."""
    missing_critical = [f"{n}: {states[n]}" for n in CRITICAL_STATES if n in states and n not in loaded]
    if missing_critical and strict:
        raise RestoreError(f"cannot restore version {meta.version} of run {engine.run!r} into the algorithm; "
                           f"nothing was changed: " + " | ".join(missing_critical))
    for name in getattr(meta, "missing", ()) or ():
        states.setdefault(name, "missing: not written (or not yet: best-effort parts land after the commit)")


# ====================================================================== step 2: the algorithm's process
def _restore_learner(learner_group: Any, loaded: Dict[str, Any], metrics: Optional[Dict[str, Any]],
                     timeout_s: float) -> Tuple[int, Dict[int, str]]:
    """Weights + optimizer (+ learner metrics) into the learner, stamped with a weights_seq_no newer than
    the checkpoint's and the learner's current one (so no env runner ignores it); returns that number
    and, with remote learners, each one's verdict (pushed into every learner and verified: learners.py)."""
    if is_remote(learner_group):
        return restore_remote_learners(learner_group, loaded, metrics, timeout_s)
    current = learner_group.get_state(components=f"{COMPONENT_LEARNER}/{WEIGHTS_SEQ_NO}")[COMPONENT_LEARNER]
    saved_seq = int(loaded.get(COUNTERS, {}).get(WEIGHTS_SEQ_NO, 0) or 0)
    new_seq = max(saved_seq, int(current.get(WEIGHTS_SEQ_NO, 0) or 0)) + 1
    learner_state: Dict[str, Any] = {WEIGHTS_SEQ_NO: new_seq}
    if POLICY in loaded:
        learner_state[COMPONENT_RL_MODULE] = from_storable(loaded[POLICY])
    if OPTIMIZER in loaded:
        learner_state[COMPONENT_OPTIMIZER] = from_storable(loaded[OPTIMIZER])
    if metrics is not None and metrics.get("learner") is not None:
        learner_state[COMPONENT_METRICS_LOGGER] = metrics["learner"]
    learner_group.foreach_learner(load_learner_state, state=learner_state)  # the local learner
    return new_seq, {}


def _restore_connectors(algorithm: Any, conn: Optional[Dict[str, Any]]) -> None:
    """The algorithm-side connector states: its local env runner's, or its own pipelines'."""
    if conn is None:
        return
    local_runner = getattr(algorithm, "env_runner", None)
    if local_runner is not None:
        local_runner.set_state(conn)
        return
    for comp, connector in algorithm_connectors(algorithm):
        if comp in conn:
            connector.set_state(conn[comp])


def _restore_counters_and_metrics(algorithm: Any, counters: Dict[str, Any],
                                  metrics: Optional[Dict[str, Any]]) -> None:
    algo_state: Dict[str, Any] = {}
    if TRAINING_ITERATION in counters:
        algo_state[TRAINING_ITERATION] = int(counters[TRAINING_ITERATION])
    if metrics is not None and metrics.get("algorithm") is not None:
        algo_state[COMPONENT_METRICS_LOGGER] = metrics["algorithm"]
    if algo_state:
        algorithm.set_state(algo_state)  # only these keys: no connector merge, no weight sync here


def _restore_rng(loaded: Dict[str, Any], states: Dict[str, str], restore_rng: bool) -> None:
    if RNG not in loaded:
        return
    if restore_rng:
        set_rng_state(from_storable(loaded[RNG]))
    else:
        states[RNG] = "not restored: restore_rng=False"


# ====================================================================== step 3: the env runners
def _sync_env_runners(algorithm: Any, loaded: Dict[str, Any], states: Dict[str, str], conn: Optional[Dict[str, Any]],
                      new_seq: int, restore_rng: bool, timeout_s: float) -> RunnerSync:
    """The learner's inference weights to the local env runner, then weights + connectors (+ their RNG
    states) to every remote one, verified; notes saved runner states that found no runner."""
    lgw = algorithm.learner_group.get_state(components=f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}",
                                            inference_only=True)[COMPONENT_LEARNER]
    weights = lgw[COMPONENT_RL_MODULE]
    seq = int(lgw.get(WEIGHTS_SEQ_NO, new_seq))
    local_runner = getattr(algorithm, "env_runner", None)
    if local_runner is not None and getattr(local_runner, "module", None) is not None:
        local_runner.set_state({COMPONENT_RL_MODULE: weights, WEIGHTS_SEQ_NO: seq})
    runner_states = saved_runner_states(loaded)
    sampled = loaded.get(COUNTERS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
    sync = push_to_env_runners(algorithm, weights, seq, conn, sampled, runner_states if restore_rng else {},
                               timeout_s)
    for i in runner_states if sync.answered is not None else ():
        if i not in sync.answered:
            states[f"{ENV_RUNNER_PREFIX}{i}"] = "not restored: no such healthy env runner now"
    return sync


def restore_algorithm(algorithm: Any, run: Union[str, CheckpointEngine], version: int = -1, *,
                      local_dir: Optional[str] = None, remote_uri: Optional[str] = None,
                      engine_options: Optional[Dict[str, Any]] = None, timeout_s: float = 60.0,
                      strict: bool = True, restore_rng: bool = True, restore_env_runners: bool = True,
                      allow_pickle: Iterable[str] = (), restore_replay: bool = True) -> AlgorithmRestoreReport:
    """Bring ``algorithm`` (built from the same config) back to ``version`` (-1: the latest) of ``run``.

    ``run``: a run name (``local_dir`` given: get-or-create its engine; else connect to the running
    one) or a CheckpointEngine. Every state is read and verified before the algorithm is touched;
    with ``strict`` a missing critical state raises RestoreError and nothing changes. Then: learner
    weights + optimizer (stamped with a new weights_seq_no), connectors, iteration counter, metrics,
    RNGs; finally one synchronous ``set_state`` on every healthy remote env runner (weights from the
    learner, connector states, its own saved RNG states), bounded by ``timeout_s``, whose answers
    are checked: a runner that does not answer in time or holds other weights / connector states
    raises RestoreError (the algorithm is then restored but its runners are not to be trusted).
    The replay buffer (``replay_journal``; off-policy algorithms) is restored first, into
    ``algorithm.local_replay_buffer`` (``restore_replay=False``: left as it is): see :mod:`.replay`;
    a version written before the journal (``replay`` + ``replay_meta``) is refused, naming ``ray-ckpt
    migrate``, which rewrites it."""
    t0 = time.perf_counter()
    engine = _resolve_engine(run, local_dir, remote_uri, engine_options)
    meta = _pick_version(engine, version)
    loaded, states = _load_states(engine, meta, restore_env_runners, set(allow_pickle))
    _require_critical(engine, meta, loaded, states, strict)
    restore_algorithm_replay(algorithm, engine, meta, loaded, states, strict=strict, enabled=restore_replay)

    metrics = from_storable(loaded[METRICS]) if METRICS in loaded else None
    conn = from_storable(loaded[CONNECTORS]) if CONNECTORS in loaded else None
    new_seq, learners = _restore_learner(algorithm.learner_group, loaded, metrics, timeout_s)
    _restore_connectors(algorithm, conn)
    _restore_counters_and_metrics(algorithm, loaded.get(COUNTERS, {}), metrics)
    _restore_rng(loaded, states, restore_rng)
    sync = _sync_env_runners(algorithm, loaded, states, conn, new_seq, restore_rng, timeout_s)

    if sync.problems:
        raise RestoreError(f"version {meta.version} of run {engine.run!r} was loaded into the learner, but the env "
                           f"runners could not be verified: " + "; ".join(sync.problems))
    return AlgorithmRestoreReport(version=meta.version, iteration=int(algorithm.iteration),
                                  weights_seq_no=sync.weights_seq_no, states=states, env_runners=sync.env_runners,
                                  weights_digest=sync.weights_digest, seconds=time.perf_counter() - t0,
                                  sync_seconds=sync.seconds, learners=learners)
