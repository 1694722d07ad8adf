"""Env runners: what a remote env runner saves of itself (``env_runner_<i>``: its process RNG states
and its environments' ``np_random`` states, read inside the runner actor), and the restore's push
of weights + connector states to every remote env runner, verified from each runner's answer.

Why a push of its own: RLlib's ``sync_weights(..)`` after ``restore_from_path`` is fire-and-forget
(``timeout_seconds=0``) through ``foreach_actor_async``, which silently *drops* a call when the
runner already has ``max_requests_in_flight_per_env_runner`` (default 1) ``set_state`` requests
outstanding, and the runner ignores weights whose ``weights_seq_no`` is not newer than its own;
either way the first iteration after a restore can sample with stale weights. :func:`push_to_env_runners`
is a blocking ``foreach_env_runner`` call (never dropped) with weights stamped by a
``weights_seq_no`` above every runner's, and each runner answers with a digest of the weights it
holds and its connector state.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import ray
from ray.rllib.core import (COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR,
                            COMPONENT_RL_MODULE, DEFAULT_MODULE_ID)
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, WEIGHTS_SEQ_NO

from ...capture.rng import rng_state, set_rng_state
from .base._rllib_internals import env_rng, remote_env_runner_actors
from .base.conversion import deep_equal, from_storable, to_storable
from .base.names import CONNECTORS, ENV_RUNNER_PREFIX

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of ray_ckpt
    torch = None

CONNECTOR_COMPONENTS = (COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR)


# ====================================================================== weights of a runner
def _keyed_by_module(module_state: Dict[str, Any]) -> Dict[str, Any]:
    """A single-agent runner's module state is not keyed by module id: key it by DEFAULT_MODULE_ID,
    as the learner's is."""
    if module_state and not all(isinstance(v, dict) for v in module_state.values()):
        return {DEFAULT_MODULE_ID: module_state}
    return module_state


def _runner_module_state(runner: Any) -> Optional[Dict[str, Any]]:
    """{module id: {param: array}} of an env runner's module (None if it has none)."""
    module = getattr(runner, "module", None)
    return None if module is None else _keyed_by_module(module.get_state())


def _weights_digest(module_state: Dict[str, Any]) -> str:
    """sha256 over every parameter (module id, name, dtype, shape, bytes) in sorted order."""
    h = hashlib.sha256()
    for mid in sorted(module_state, key=str):
        params = module_state[mid]
        if not isinstance(params, dict):
            continue
        for k in sorted(params, key=str):
            v = params[k]
            if torch is not None and isinstance(v, torch.Tensor):
                v = v.detach().cpu().numpy()
            a = np.ascontiguousarray(np.asarray(v))
            h.update(f"{mid}/{k}|{a.dtype.str}|{a.shape}|".encode())
            h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def env_runner_weights(algorithm: Any, timeout_s: float = 60.0) -> Dict[int, Dict[str, Any]]:
    """{remote runner id: {module id: {param: array}}} fetched from the remote env runners (for checks)."""
    answers = algorithm.env_runner_group.foreach_env_runner(
        lambda r: (r.worker_index, _runner_module_state(r)), local_env_runner=False, timeout_seconds=timeout_s)
    return dict(answers)


# ====================================================================== a runner's own state (saving)
def _sub_envs(runner: Any) -> List[Any]:
    env = getattr(runner, "env", None)
    if env is None:
        return []
    base = getattr(env, "unwrapped", env)
    envs = getattr(base, "envs", None)
    return list(envs) if envs is not None else [base]


def _env_rng_states(runner: Any) -> List[Any]:
    out = []
    for e in _sub_envs(runner):
        gen = env_rng(e)
        out.append(gen.bit_generator.state if gen is not None else None)
    return out


def _set_env_rng_states(runner: Any, states: List[Any]) -> int:
    n = 0
    for e, st in zip(_sub_envs(runner), states or []):
        if st is None:
            continue
        bg = getattr(np.random, st["bit_generator"])()
        bg.state = st
        getattr(e, "unwrapped", e).np_random = np.random.Generator(bg)
        n += 1
    return n


def _runner_state(runner: Any) -> Dict[str, Any]:
    """What ``env_runner_<i>`` holds: read inside the env runner actor."""
    return {"worker_index": getattr(runner, "worker_index", None), "process_rng": rng_state(),
            "env_rng": _env_rng_states(runner)}


def _install_runner_provider(runner: Any) -> None:
    """Runs inside a remote env runner (``__ray_call__``): give it the engine's actor protocol.

    Installed again before every snapshot (an actor restarted by Ray comes back without it); per-caller
    ordering runs this before the engine's snapshot call, which is submitted right after it."""
    if getattr(runner, "_ray_ckpt_provider", False):
        return

    def ckpt_get_state(name: str) -> Any:
        return to_storable(_runner_state(runner), name)

    runner.ckpt_get_state = ckpt_get_state
    runner._ray_ckpt_provider = True


def runner_snapshot_actors(algorithm: Any) -> Dict[str, Any]:
    """{``env_runner_<i>``: actor handle} of every remote env runner, each made ready to answer the
    engine's snapshot call (``ckpt_get_state``) of its own state. Every runner, healthy or not: one
    that cannot answer is then reported missing in the version (best-effort), not silently left out."""
    group = getattr(algorithm, "env_runner_group", None)
    handles = remote_env_runner_actors(group) if group is not None else {}
    out = {}
    for i, h in handles.items():
        h.__ray_call__.remote(_install_runner_provider)  # ordered before the engine's snapshot call
        out[f"{ENV_RUNNER_PREFIX}{i}"] = h
    return out


def saved_runner_states(loaded: Dict[str, Any]) -> Dict[int, Any]:
    """{runner id: its ``env_runner_<i>`` state} among the loaded states of a version."""
    out = {}
    for name, st in loaded.items():
        if name.startswith(ENV_RUNNER_PREFIX):
            try:
                out[int(name[len(ENV_RUNNER_PREFIX):])] = st
            except ValueError:
                pass
    return out


# ====================================================================== the restore's push (in each runner)
def _without_sampled(state: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in state.items() if k != NUM_ENV_STEPS_SAMPLED_LIFETIME}


def _apply_on_runner(runner: Any, payload: Dict[str, Any]) -> Dict[str, Any]:
    """Runs inside each remote env runner: load connectors + weights (+ its RNG states), then report
    what it now holds, so the driver can verify it."""
    idx = getattr(runner, "worker_index", None)
    runner.set_state(payload["state"])
    rng_note = ""
    own = (payload.get("runner_states") or {}).get(idx)
    if own is not None:
        own = from_storable(own)
        set_rng_state(own["process_rng"])
        rng_note = f"rng+{_set_env_rng_states(runner, own.get('env_rng') or [])} env rng"
    has_module = getattr(runner, "module", None) is not None
    held = runner.get_state(components=list(CONNECTOR_COMPONENTS) + ([COMPONENT_RL_MODULE] if has_module else []))
    module_state = held.pop(COMPONENT_RL_MODULE, None)
    seq = held.pop(WEIGHTS_SEQ_NO, None)
    digest = _weights_digest(_keyed_by_module(module_state)) if module_state is not None else ""
    return {"worker_index": idx, "digest": digest, "weights_seq_no": seq, "rng": rng_note,
            "connectors": to_storable(_without_sampled(held), CONNECTORS, True)}


@dataclass
class RunnerSync:
    """The outcome of :func:`push_to_env_runners`. ``env_runners``: runner id (negative: evaluation
    runners) -> "verified" or the problem; ``answered``: ids of the training runners that answered
    (None: there are no remote training runners)."""

    weights_seq_no: int
    weights_digest: str
    env_runners: Dict[int, str] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    answered: Optional[set] = None
    seconds: float = 0.0


def _runner_groups(algorithm: Any) -> Iterator[Tuple[str, Any]]:
    """("train" | "eval", group) of each env runner group that has remote runners."""
    for kind, attr in (("train", "env_runner_group"), ("eval", "eval_env_runner_group")):
        group = getattr(algorithm, attr, None)
        if group is not None and group.num_remote_env_runners():
            yield kind, group


def _verdict(answer: Optional[Dict[str, Any]], sync: RunnerSync, conn_expected: Any, timeout_s: float) -> str:
    if answer is None:
        return f"no answer within {timeout_s}s"
    if answer["digest"] != sync.weights_digest:
        return f"holds other weights (its weights_seq_no {answer['weights_seq_no']}, pushed {sync.weights_seq_no})"
    if conn_expected is not None and not deep_equal(answer["connectors"], conn_expected):
        return "holds other connector states"
    return "verified"


def push_to_env_runners(algorithm: Any, weights: Dict[str, Any], seq: int, connectors: Optional[Dict[str, Any]],
                        sampled: Optional[int], runner_states: Dict[int, Any], timeout_s: float) -> RunnerSync:
    """Set ``weights`` (stamped ``seq``) + ``connectors`` on every healthy remote env runner (training and
    evaluation), the sampled-steps counter and each training runner's own saved RNG states
    (``runner_states``) too, with one blocking call bounded by ``timeout_s``; verify every answer."""
    sync = RunnerSync(weights_seq_no=seq, weights_digest=_weights_digest(weights))
    t0 = time.perf_counter()
    conn = _without_sampled(connectors) if connectors is not None else None
    conn_expected = to_storable(conn, CONNECTORS, True) if conn is not None else None
    weights_ref = ray.put(weights)
    for kind, group in _runner_groups(algorithm):
        push: Dict[str, Any] = {COMPONENT_RL_MODULE: weights_ref, WEIGHTS_SEQ_NO: seq, **(conn or {})}
        if sampled is not None and kind == "train":
            push[NUM_ENV_STEPS_SAMPLED_LIFETIME] = int(sampled)
        payload = {"state": push, "runner_states": runner_states if kind == "train" else {}}
        expected = list(group.healthy_env_runner_ids())
        answers = group.foreach_env_runner(lambda r, p=payload: _apply_on_runner(r, p),
                                           local_env_runner=False, timeout_seconds=timeout_s)
        by_id = {a["worker_index"]: a for a in answers}
        sign = 1 if kind == "train" else -1
        for i in expected:
            verdict = sync.env_runners[sign * i] = _verdict(by_id.get(i), sync, conn_expected, timeout_s)
            if verdict != "verified":
                sync.problems.append(f"{kind} env runner {i}: {verdict}")
        if kind == "train":
            sync.answered = set(by_id)
        for i in sorted(set(remote_env_runner_actors(group)) - set(expected)):
            sync.env_runners[sign * i] = "unhealthy: RLlib syncs it from the learner when it is restored"
    sync.seconds = time.perf_counter() - t0
    return sync
