"""Reading one version's in-process states out of an Algorithm (RLlib state -> storable state).

============== ============ ==========================================================================
name           strategy     content
============== ============ ==========================================================================
policy         CRITICAL     the learner's RLModule weights (``learner_group.get_state``), every module
optimizer      CRITICAL     the learner's optimizer states (moments, step counts, param groups)
                            -- with remote learners (``num_learners >= 1``) both, and the learner half
                            of ``metrics``, are captured inside the first learner actor, not here
                            (:mod:`.learners`)
connectors     CRITICAL     env-to-module / module-to-env connector states of the algorithm's env
                            runner (the merged MeanStdFilter statistics, ...) and its sampled-steps
                            counter
counters       CRITICAL     training_iteration, the learner's weights_seq_no, env steps sampled
rng            CRITICAL     python / numpy / torch RNG states of the algorithm's process (which also
                            holds the learner when ``num_learners=0``)
metrics        BEST_EFFORT  the algorithm's and the learner's MetricsLogger states (lifetime counters,
                            smoothing windows)
replay_journal CRITICAL     off-policy algorithms' ``local_replay_buffer``, as a journal of what its
                            add() and update_priorities() received (registered append-only:
                            :mod:`.replay`); the callback's ``replay_strategy`` ("auto": CRITICAL
                            when there is a buffer). Versions written before the journal hold
                            ``replay`` + ``replay_meta`` instead: ``ray-ckpt migrate`` rewrites them
env_runner_<i> BEST_EFFORT  remote env runner i: its process RNG states and its environments'
                            ``np_random`` states (captured inside the runner: :mod:`.env_runners`)
============== ============ ==========================================================================
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ray.rllib.core import (COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_LEARNER, COMPONENT_METRICS_LOGGER,
                            COMPONENT_MODULE_TO_ENV_CONNECTOR, COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE)
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME, WEIGHTS_SEQ_NO

from ...errors import UnsupportedTypeError
from ...capture.rng import rng_state
from .base.conversion import to_storable
from .env_runners import CONNECTOR_COMPONENTS
from .base.learner_params import with_outside_params
from .learners import is_remote, reported_weights_seq_no
from .base.names import CONNECTORS, COUNTERS, METRICS, OPTIMIZER, POLICY, RNG, TRAINING_ITERATION
from .replay.algorithm import capture_algorithm_replay


# states the callback registers with overlap=True: a local learner's weights and optimizer as
# RLlib's get_state returns them, numpy copies of the parameters and moments (not views: the learner's
# next update does not change them), so their put into the object store runs on the process's copy
# thread while train() goes on, with no fence and no copy of ours (from 4 MiB: smaller ones are put
# in the save call, capture/calls.py OVERLAP_MIN_BYTES); tests/test_rllib.py
# (test_a_local_learners_state_is_saved_as_it_was_at_save) checks it on the newest and the oldest Ray.
# The replay states are new arrays by construction (replay/algorithm.py)
OVERLAPPED = (POLICY, OPTIMIZER)


def _learner_components(metrics: bool) -> List[str]:
    comps = [f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}", f"{COMPONENT_LEARNER}/{COMPONENT_OPTIMIZER}"]
    if metrics:
        comps.append(f"{COMPONENT_LEARNER}/{COMPONENT_METRICS_LOGGER}")
    return comps


def algorithm_connectors(algorithm: Any) -> Iterator[Tuple[str, Any]]:
    """(component name, connector pipeline) of an algorithm that has no local env runner."""
    for comp, attr in ((COMPONENT_ENV_TO_MODULE_CONNECTOR, "env_to_module_connector"),
                       (COMPONENT_MODULE_TO_ENV_CONNECTOR, "module_to_env_connector")):
        conn = getattr(algorithm, attr, None)
        if conn is not None:
            yield comp, conn


def _connector_state(algorithm: Any) -> Optional[Dict[str, Any]]:
    if not getattr(algorithm.config, "is_online", True):
        return None
    runner = getattr(algorithm, "env_runner", None)
    if runner is not None:
        return runner.get_state(components=list(CONNECTOR_COMPONENTS))
    return {comp: conn.get_state() for comp, conn in algorithm_connectors(algorithm)}


def capture_algorithm_state(algorithm: Any, *, rng: bool = True, metrics: bool = True,
                            allow_pickle: Iterable[str] = (),
                            errors: Optional[Dict[str, str]] = None, replay: Any = None,
                            engine: Any = None) -> Dict[str, Any]:
    """The in-process states of one version, converted with :func:`to_storable`: ``policy``,
    ``optimizer``, ``connectors``, ``counters`` (+ ``rng``, ``metrics``). A critical state that cannot
    be converted raises; a best-effort one (``metrics``) is left out and its reason put in ``errors``.
    With remote learners ``policy`` / ``optimizer`` are left out and ``metrics`` holds only the
    algorithm half: the learner actor captures the rest (:class:`.learners.LearnerCapture`)."""
    pickled = set(allow_pickle)
    # remote learners: policy / optimizer / the learner's metrics are snapshotted in the learner actor
    # (learners.py), never fetched into this process; they are not in the result
    remote = is_remote(algorithm.learner_group)
    lg = {} if remote else algorithm.learner_group.get_state(
        components=_learner_components(metrics))[COMPONENT_LEARNER]
    out: Dict[str, Any] = {}
    if not remote:  # RLlib's copies: the callback's copy thread puts them into the object store (OVERLAPPED)
        out[POLICY] = to_storable(lg[COMPONENT_RL_MODULE], POLICY, POLICY in pickled)
        opt = lg[COMPONENT_OPTIMIZER]
        algorithm.learner_group.foreach_learner(with_outside_params, optimizer_state=opt)  # SAC's log_alpha
        out[OPTIMIZER] = to_storable(opt, OPTIMIZER, OPTIMIZER in pickled)
    conn = _connector_state(algorithm)
    out[CONNECTORS] = to_storable(conn if conn is not None else {}, CONNECTORS, CONNECTORS in pickled)
    sampled = algorithm.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)
    out[COUNTERS] = {
        TRAINING_ITERATION: int(algorithm.iteration),
        WEIGHTS_SEQ_NO: reported_weights_seq_no(algorithm) if remote else int(lg.get(WEIGHTS_SEQ_NO, 0) or 0),
        NUM_ENV_STEPS_SAMPLED_LIFETIME: int(sampled or 0),
    }
    if rng:
        out[RNG] = to_storable(rng_state(), RNG)
    if metrics:
        try:
            out[METRICS] = to_storable({"algorithm": algorithm.metrics.get_state(),
                                        "learner": lg.get(COMPONENT_METRICS_LOGGER)},
                                       METRICS, METRICS in pickled)
        except (UnsupportedTypeError, TypeError) as exc:  # TypeError: RLlib's get_state on int agent ids
            if errors is None:
                raise
            errors[METRICS] = f"{type(exc).__name__}: {exc}"
    if replay is not None:  # a Strategy: the replay buffer's journal (:mod:`.replay`)
        capture_algorithm_replay(algorithm, out, replay, engine, errors)
    return out
