"""Remote learners (``num_learners >= 1``): ``policy``, ``optimizer`` and ``metrics`` captured *inside
the first learner actor*, and the restore's push into every learner, verified from each one's answer.

Saving. With remote learners the callback registers ``policy`` / ``optimizer`` (CRITICAL) and
``metrics`` (BEST_EFFORT) with the engine as states of the first healthy learner actor (an actor
provider), after installing a ``ckpt_get_state`` on that actor (``__ray_call__``, again before every
save: an actor Ray restarted comes back without it). The engine's snapshot call then runs in the
learner: ``Learner.get_state`` of that one component, converted by :func:`.conversion.to_storable`
and flattened there; Ray copies the result into the object store from the learner's process and
the ObjectRef goes to a writer. The algorithm's process awaits no call and never holds the bytes:
``train()`` waits for no transfer (before, ``learner_group.get_state`` fetched the whole learner
state into it synchronously at every save).

Under DDP (``num_learners >= 2``) every learner holds the same weights and optimizer state after
each update (DDP all-reduces the gradients, each learner applies the same step to the same
parameters), so only the first healthy learner -- the one RLlib's own ``LearnerGroup.get_state``
reads -- is captured; the learner half of ``metrics`` is that learner's MetricsLogger too.

Same names and shapes as with ``num_learners=0`` (:mod:`.capture`): ``policy`` is
``{module id: {param: array}}``, ``optimizer`` RLlib's optimizer state, ``metrics``
``{"algorithm": ..., "learner": ...}`` -- the algorithm half is read in the algorithm's process and
travels to the learner with the install call, which returns it with its own half. A version saved
with one ``num_learners`` restores into an Algorithm built with another.

Consistency: why the state captured is the one after this iteration's update, and no later one.

- The callback calls ``engine.save()`` from ``on_train_result``, in the algorithm's process (the
  driver, or Tune's trainable actor). That is also the process that owns the LearnerGroup and
  submits every learner call (``learner_group.update``); ``save()`` submits its snapshot calls
  itself, in the caller's thread (``capture.calls.take_snapshots``), so both have one caller.
- Synchronous updates (PPO, DQN, SAC, ...: ``learner_group.update(async_update=False)``) return only
  after every learner finished (``FaultTolerantActorManager.foreach_actor`` gets the results), i.e.
  before ``training_step`` returns and long before ``on_train_result``: the update is complete before
  the snapshot call is even submitted.
- Learner actors are plain actors (one call at a time, no ``max_concurrency``), so Ray's per-caller
  ordering runs the snapshot after every call this process submitted before it (the install call
  included) and before the next iteration's update; the three snapshot calls are submitted back to
  back by one ``save()``, so no call of this process runs between them, and no other process calls
  the learners.
- Not covered: asynchronous learners (IMPALA / APPO with ``num_learners >= 1``), whose ``update`` only
  queues the batch for the learner's own update thread: the snapshot holds whatever that thread has
  applied when it runs, possibly mid-step -- as RLlib's own ``get_state`` does. Logged once.

Restoring. :func:`restore_remote_learners` stamps the state with a ``weights_seq_no`` above every
learner's (so none ignores the weights), puts it into the object store once, runs ``set_state`` in
each learner (healthy or not) and has each answer with digests of the weights and optimizer state it
then holds; a learner that does not answer within the bound, fails, or holds anything else raises
:class:`~ray_ckpt.RestoreError` naming it.
"""
from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import ray
from ray.rllib.core import COMPONENT_METRICS_LOGGER, COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.utils.metrics import LEARNER_RESULTS, WEIGHTS_SEQ_NO

from ...errors import RestoreError, SaveError
from ...capture.snapshot import actor_provider
from ...types import Strategy
from .base._rllib_internals import load_learner_state, remote_learners
from .base.conversion import from_storable, to_storable
from .base.learner_params import OUTSIDE_MODULE, with_outside_params
from .base.names import COUNTERS, METRICS, OPTIMIZER, POLICY, log

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of ray_ckpt
    torch = None

LEARNER_STATES = {POLICY: COMPONENT_RL_MODULE, OPTIMIZER: COMPONENT_OPTIMIZER, METRICS: COMPONENT_METRICS_LOGGER}


def is_remote(learner_group: Any) -> bool:
    """Whether the Algorithm's learners are remote actors (``num_learners >= 1``)."""
    return bool(getattr(learner_group, "is_remote", False))


def reported_weights_seq_no(algorithm: Any) -> int:
    """The learners' ``weights_seq_no`` as their last update reported it to the algorithm (the
    highest over modules; 0 if none), read from ``algorithm.metrics`` without calling a learner."""
    best = 0
    try:
        merged = algorithm.metrics.peek((LEARNER_RESULTS,), default={}, latest_merged_only=True)
    except Exception:  # no learner results yet, or a MetricsLogger without latest_merged_only
        return 0
    for mid in merged if isinstance(merged, dict) else ():
        v = merged[mid].get(WEIGHTS_SEQ_NO) if isinstance(merged[mid], dict) else None
        try:
            v = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            best = max(best, int(v))
    return best


# ====================================================================== saving (in the first learner)
def _learner_component(learner: Any, name: str) -> Any:
    comp = LEARNER_STATES[name]
    state = learner.get_state(components=comp)[comp]
    return with_outside_params(learner, state) if name == OPTIMIZER else state  # SAC's log_alpha too


def _install_learner_provider(learner: Any, pickled: Tuple[str, ...], algorithm_metrics: Any) -> None:
    """Runs inside the learner actor (``__ray_call__``) before every save: the engine's actor protocol
    (``ckpt_get_state``) and this save's algorithm half of ``metrics`` (already storable; None: it
    was not captured). Per-caller ordering runs it before the engine's snapshot calls."""
    learner.ray_ckpt_algorithm_metrics = algorithm_metrics
    if getattr(learner, "ray_ckpt_pickled", None) == pickled:
        return

    def ckpt_get_state(name: str) -> Any:
        if name not in LEARNER_STATES:
            raise SaveError(f"remote learner: no state {name!r} (it holds {sorted(LEARNER_STATES)})")
        own = to_storable(_learner_component(learner, name), name, name in pickled)
        if name != METRICS:
            return own
        algo = learner.ray_ckpt_algorithm_metrics
        if algo is None:
            raise SaveError("the algorithm's metrics were not captured for this save")
        return {"algorithm": algo, "learner": own}

    learner.ckpt_get_state = ckpt_get_state
    learner.ray_ckpt_pickled = pickled


def _first_learner(learner_group: Any) -> Tuple[int, Any]:
    try:
        handles, healthy = remote_learners(learner_group)
    except RuntimeError as exc:
        raise SaveError(str(exc)) from None
    for i in healthy:
        if i in handles:
            return i, handles[i]
    raise SaveError(f"no healthy remote learner to capture {POLICY!r} / {OPTIMIZER!r} from "
                    f"(learners: {sorted(handles)}, healthy: {healthy})")


_warned_async = False


def _warn_if_async(algorithm: Any) -> None:
    global _warned_async
    if _warned_async:
        return
    try:
        from ray.rllib.algorithms.impala import IMPALAConfig
    except ImportError:  # pragma: no cover
        return
    if isinstance(getattr(algorithm, "config", None), IMPALAConfig):
        _warned_async = True
        log.warning("ray_ckpt: %s updates its remote learners on their own thread: a save captures what that "
                    "thread has applied when the snapshot runs, not exactly this iteration's state",
                    type(algorithm).__name__)


class LearnerCapture:
    """The callback's part for remote learners: before each save, (re)install the provider in the
    first healthy learner and (re)register ``policy`` / ``optimizer`` / ``metrics`` to it."""

    def __init__(self) -> None:
        self.registered: Dict[str, Any] = {}  # name -> the learner handle it is registered to
        self.learner_id: Optional[int] = None
        self._engine: Any = None

    def sync(self, engine: Any, algorithm: Any, pending: Dict[str, Any], allow_pickle: Tuple[str, ...]) -> None:
        """``pending``: this save's in-process states (:func:`.capture.capture_algorithm_state`); its
        ``metrics``, if any, holds the algorithm half. Nothing here waits for the learner."""
        if not is_remote(algorithm.learner_group):
            return
        _warn_if_async(algorithm)
        if engine is not self._engine:  # a new engine (e.g. a new run): register everything again
            self._engine, self.registered = engine, {}
        self.learner_id, handle = _first_learner(algorithm.learner_group)
        algo_metrics = pending[METRICS].get("algorithm") if METRICS in pending else None
        pickled = tuple(allow_pickle)
        handle.__ray_call__.remote(_install_learner_provider, pickled, algo_metrics)  # ordered before the snapshot
        names = {POLICY: Strategy.CRITICAL, OPTIMIZER: Strategy.CRITICAL}
        if METRICS in pending:
            names[METRICS] = Strategy.BEST_EFFORT
        for name in set(self.registered) - set(names):
            del self.registered[name]  # the callback unregistered it (metrics not captured this time)
        for name, strategy in names.items():
            if self.registered.get(name) is not handle:
                engine.register(name, actor_provider(handle), strategy=strategy, allow_pickle=name in pickled,
                                replace=True)
                self.registered[name] = handle


# ====================================================================== restoring (into every learner)
def state_digest(state: Any) -> str:
    """sha256 over a nested state: dict keys (sorted), sequence items, array dtype / shape / bytes
    (a torch tensor as the numpy array it converts to), scalars by type and repr."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if torch is not None and isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            try:
                x = t.numpy()
            except TypeError:  # bfloat16 and other dtypes numpy lacks
                h.update(f"a|{t.dtype}|{tuple(t.shape)}|".encode())
                h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                return
        if isinstance(x, (np.ndarray, np.generic)):
            a = np.ascontiguousarray(np.asarray(x))
            h.update(f"a|{a.dtype.str}|{a.shape}|".encode())
            h.update(memoryview(a.reshape(-1).view(np.uint8)))
        elif isinstance(x, dict):
            h.update(f"d{len(x)}|".encode())
            for k in sorted(x, key=repr):
                h.update(f"k{type(k).__name__}:{k!r}|".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"l{len(x)}|".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"s{type(x).__name__}:{x!r}|".encode())

    walk(state)
    return h.hexdigest()


def _learner_seq(learner: Any) -> int:
    return int(learner.get_state(components=WEIGHTS_SEQ_NO).get(WEIGHTS_SEQ_NO, 0) or 0)


def _apply_on_learner(learner: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """Runs inside each learner actor: load the state, then report what the learner now holds."""
    load_learner_state(learner, state)
    held = learner.get_state(components=[COMPONENT_RL_MODULE, COMPONENT_OPTIMIZER])
    saved_opt = state.get(COMPONENT_OPTIMIZER) or {}
    opt = with_outside_params(learner, held[COMPONENT_OPTIMIZER],  # as the version holds them (older: none)
                              only=[n for n, v in saved_opt.items() if isinstance(v, dict) and OUTSIDE_MODULE in v])
    return {WEIGHTS_SEQ_NO: int(held.get(WEIGHTS_SEQ_NO, 0) or 0),
            POLICY: state_digest(held[COMPONENT_RL_MODULE]),
            OPTIMIZER: state_digest(to_storable(opt, OPTIMIZER, True))}


def _answers(calls: Dict[int, Any], timeout_s: float) -> Dict[int, Any]:
    """{learner id: its answer, or the problem as a string}, waiting at most ``timeout_s`` for all."""
    refs = list(calls.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ready_set = set(ready)
    out: Dict[int, Any] = {}
    for i, ref in calls.items():
        if ref not in ready_set:
            out[i] = f"no answer within {timeout_s}s"
            continue
        try:
            out[i] = ray.get(ref, timeout=0)
        except Exception as exc:  # a dead or failing learner: named, not fatal to the others' verdicts
            out[i] = f"failed: {_why(exc)}"
    return out


def _why(exc: BaseException) -> str:
    """One line: the learner's own exception (a RayTaskError's cause), whitespace folded, capped."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}{'...' if len(text) > 400 else ''}"


def _verdicts(answers: Dict[int, Any], expected: Dict[str, Optional[str]], seq: int) -> Dict[int, str]:
    """learner id -> "verified" or what is wrong. ``expected``: state name -> digest of what was
    pushed (None: not pushed; then every learner must hold what the first one answering holds)."""
    first = next((a for a in answers.values() if isinstance(a, dict)), None)
    want = {n: d if d is not None else (first[n] if first else None) for n, d in expected.items()}
    out: Dict[int, str] = {}
    for i, a in sorted(answers.items()):
        if not isinstance(a, dict):
            out[i] = a
        elif a[WEIGHTS_SEQ_NO] != seq:
            out[i] = f"holds weights_seq_no {a[WEIGHTS_SEQ_NO]}, pushed {seq}"
        elif a[POLICY] != want[POLICY]:
            out[i] = (f"holds other weights than the version's {POLICY!r}" if expected[POLICY] is not None
                      else "holds other weights than the other learners")
        elif a[OPTIMIZER] != want[OPTIMIZER]:
            out[i] = (f"holds another optimizer state than the version's {OPTIMIZER!r}"
                      if expected[OPTIMIZER] is not None else "holds another optimizer state than the other learners")
        else:
            out[i] = "verified"
    return out


def restore_remote_learners(learner_group: Any, loaded: Dict[str, Any], metrics: Optional[Dict[str, Any]],
                            timeout_s: float) -> Tuple[int, Dict[int, str]]:
    """Push ``policy`` / ``optimizer`` (+ the learner half of ``metrics``) of a loaded version into
    every remote learner, stamped with a ``weights_seq_no`` above the version's and every learner's;
    verify each answer. Returns (that weights_seq_no, {learner id: "verified"}); raises RestoreError
    naming each learner that did not answer within ``timeout_s`` or holds anything else."""
    deadline = time.monotonic() + timeout_s
    try:
        handles, _ = remote_learners(learner_group)
    except RuntimeError as exc:
        raise RestoreError(str(exc)) from None
    if not handles:
        raise RestoreError("the algorithm has remote learners (num_learners >= 1) but none could be found")
    seqs = _answers({i: h.__ray_call__.remote(_learner_seq) for i, h in handles.items()}, timeout_s)
    bad = {i: a for i, a in seqs.items() if not isinstance(a, int)}
    if bad:
        raise RestoreError("remote learners could not be read before the restore; nothing was restored: "
                           + "; ".join(f"learner {i}: {a}" for i, a in sorted(bad.items())))
    saved_seq = int(loaded.get(COUNTERS, {}).get(WEIGHTS_SEQ_NO, 0) or 0)
    seq = max([saved_seq] + list(seqs.values())) + 1
    state: Dict[str, Any] = {WEIGHTS_SEQ_NO: seq}
    expected: Dict[str, Optional[str]] = {POLICY: None, OPTIMIZER: None}
    if POLICY in loaded:
        state[COMPONENT_RL_MODULE] = from_storable(loaded[POLICY])
        expected[POLICY] = state_digest(state[COMPONENT_RL_MODULE])
    if OPTIMIZER in loaded:
        state[COMPONENT_OPTIMIZER] = from_storable(loaded[OPTIMIZER])
        expected[OPTIMIZER] = state_digest(to_storable(state[COMPONENT_OPTIMIZER], OPTIMIZER, True))
    if metrics is not None and metrics.get("learner") is not None:
        state[COMPONENT_METRICS_LOGGER] = metrics["learner"]
    ref = ray.put(state)
    left = max(0.0, deadline - time.monotonic())
    answers = _answers({i: h.__ray_call__.remote(_apply_on_learner, ref) for i, h in handles.items()}, left)
    verdicts = _verdicts(answers, expected, seq)
    problems = [f"learner {i}: {v}" for i, v in verdicts.items() if v != "verified"]
    if problems:
        raise RestoreError(f"the version was pushed into the {len(handles)} remote learner(s), but not every one "
                           f"holds it: " + "; ".join(problems))
    return seq, verdicts


def learner_ids(learner_group: Any) -> List[int]:
    """The remote learners' ids (for reports and tests)."""
    return sorted(remote_learners(learner_group)[0]) if is_remote(learner_group) else []
