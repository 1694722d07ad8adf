"""RLlib (new API stack) integration: non-blocking checkpoints of an Algorithm, and a restore that
leaves every env runner verifiably on the restored weights.

Saving -- a callback::

    from ray_ckpt.integrations.rllib import make_callback, restore_algorithm

    config = (PPOConfig().environment("CartPole-v1")
              .callbacks(make_callback("ppo-run", local_dir="/mnt/nvme/ckpt",
                                       remote_uri="s3://bucket/ckpt", every=5, keep_last=3)))
    algo = config.build_algo()
    for _ in range(100):
        algo.train()          # every 5th iteration is saved; train() never waits for storage

``make_callback(...)`` returns a subclass of :class:`RayCkptCallback` with the settings bound (RLlib
instantiates callbacks from a class, in the algorithm's process and in every env runner);
``functools.partial(RayCkptCallback, "ppo-run", local_dir=...)`` works too. Only the instance in the
algorithm's process ever touches the engine: it is created (get-or-create, by run name) in
``on_algorithm_init``, so the first ``train()`` does not pay for the coordinator's start-up.

What one version holds (state names in the engine):

============== ============ ==========================================================================
name           strategy     content
============== ============ ==========================================================================
policy         CRITICAL     the learner's RLModule weights (``learner_group.get_state``), every module
optimizer      CRITICAL     the learner's optimizer states (moments, step counts, param groups)
connectors     CRITICAL     env-to-module / module-to-env connector states of the algorithm's env
                            runner (the merged MeanStdFilter statistics, ...) and its sampled-steps
                            counter
counters       CRITICAL     training_iteration, the learner's weights_seq_no, env steps sampled
rng            CRITICAL     python / numpy / torch RNG states of the algorithm's process (which also
                            holds the learner when ``num_learners=0``)
metrics        BEST_EFFORT  the algorithm's and the learner's MetricsLogger states (lifetime counters,
                            smoothing windows)
env_runner_<i> BEST_EFFORT  remote env runner i: its process RNG states and its environments'
                            ``np_random`` states (captured inside the runner, see below)
============== ============ ==========================================================================

Why ``train()`` is not blocked: the callback runs in the algorithm's process right after the
iteration. It reads the local learner's state (numpy views of the torch parameters, no copy), the
connector states (small) and the RNG states, and calls ``engine.save(iteration)``, which flattens
them (no copy) and ``ray.put`` s them: one memcpy of the state, the floor. Serialising,
checksumming, writing and uploading happen in the engine's writer actors. A remote env runner's
state is snapshotted *inside that runner* (the callback installs a ``ckpt_get_state`` on the actor
and registers the actor handle; the engine submits the snapshot, whose ObjectRef goes straight to
a writer), so no remote call is awaited either. If ``max_in_flight`` saves are still in flight,
``on_busy="skip"`` (default) skips that iteration's save instead of waiting (counted and logged).
Exception: with remote learners (``num_learners > 0``), ``learner_group.get_state`` fetches the
state from the first learner actor, which waits for that transfer (what RLlib's own checkpointing
does too).

Formats: RLlib state dicts hold a few things the engine's formats (no pickle on the default path)
refuse or would store opaquely; they are converted losslessly, and converted back on restore:
dicts with ``None`` / bool / tuple keys (MeanStdFilter keys its single-agent filter by ``None``)
become a list of ``(key, value)`` pairs; ``RunningStat`` arrays, which RLlib serialises as base64
``np.save`` strings that it reloads with ``allow_pickle=True``, are stored as plain numpy arrays;
sets are tagged lists. Anything else that is not a tensor, array, Arrow table or JSON scalar raises
:class:`~ray_ckpt.UnsupportedTypeError` naming the state and the key path -- nothing is dropped.
``allow_pickle=("metrics",)`` opts a state into pickle instead.

Restoring -- :func:`restore_algorithm` (a fresh or a running Algorithm built from the same config):
reads every state of one version (verified, local tier first, remote tier as fallback) *before*
touching the algorithm, sets the learner (weights, optimizer, a new ``weights_seq_no``), the
connectors, counters, metrics and RNGs, then pushes weights + connector states to every remote env
runner with a synchronous call bounded by ``timeout_s`` and verifies each runner's answer (a digest
of its module weights, its connector state). RLlib's own ``sync_weights(..)`` after
``restore_from_path`` is fire-and-forget (``timeout_seconds=0``) through
``foreach_actor_async``, which silently *drops* a call when the runner already has
``max_requests_in_flight_per_env_runner`` (default 1) ``set_state`` requests outstanding, and the
runner ignores weights whose ``weights_seq_no`` is not newer than its own; either way the first
iteration after a restore can sample with stale weights. The helper avoids both: its push is a
blocking ``foreach_env_runner`` call (never dropped), and it stamps the restored weights with a
``weights_seq_no`` above both the checkpoint's and the learner's current one, so no runner ignores
them and later syncs from the learner keep applying.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import io
import logging
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import ray

from ..engine import CheckpointEngine, SaveHandle
from ..errors import (CheckpointError, InvalidArgumentError, RestoreError, SaveError,
                      UnsupportedTypeError)
from ..rng import rng_state, set_rng_state
from ..storage.layout import validate_name
from ..types import OnBusy, SaveResult, Strategy

try:
    import torch
except ImportError:  # pragma: no cover - torch is a dependency of ray_ckpt
    torch = None

try:
    import pyarrow as pa
except ImportError:  # pragma: no cover
    pa = None

try:
    from ray.rllib.callbacks.callbacks import RLlibCallback
    from ray.rllib.core import (COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_LEARNER,
                                COMPONENT_METRICS_LOGGER, COMPONENT_MODULE_TO_ENV_CONNECTOR,
                                COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID)
    from ray.rllib.utils.metrics import (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME,
                                         WEIGHTS_SEQ_NO)
except ImportError as _exc:  # pragma: no cover - exercised only without ray[rllib]
    raise ImportError(
        "ray_ckpt.integrations.rllib needs RLlib and its dependencies (gymnasium, ...): "
        f'pip install "ray-ckpt[rllib]" (or "ray[rllib]=={ray.__version__}"); {_exc}') from None

TRAINING_ITERATION = "training_iteration"

log = logging.getLogger("ray_ckpt.rllib")

POLICY = "policy"
OPTIMIZER = "optimizer"
CONNECTORS = "connectors"
COUNTERS = "counters"
RNG = "rng"
METRICS = "metrics"
ENV_RUNNER_PREFIX = "env_runner_"

CRITICAL_STATES = (POLICY, OPTIMIZER, CONNECTORS, COUNTERS, RNG)

__all__ = [
    "CheckpointSettings", "RayCkptCallback", "make_callback", "restore_algorithm",
    "AlgorithmRestoreReport", "capture_algorithm_state", "find_callback", "wait_for_saves",
    "to_storable", "from_storable", "env_runner_weights",
]


# ====================================================================== storable conversion
_ITEMS = "__ray_ckpt_items__"   # a dict whose keys the formats do not support: list of (key, value)
_NPY = "__ray_ckpt_npy__"       # an RLlib base64(zlib(np.save)) array string, stored as an array
_SET = "__ray_ckpt_set__"       # a set / frozenset: {_SET: [items], "frozen": bool}
_MARK = "__ray_ckpt_"
_RUNNING_STAT_ARRAYS = ("mean_array", "mean_delta_array", "sum_sq_diff_array", "sum_sq_diff_delta_array")


def _path_str(path: Sequence[Any]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def _decode_npy_b64(s: str) -> Optional[np.ndarray]:
    """RLlib's ``_serialize_ndarray`` string -> array, without ever unpickling (None if it is not one)."""
    try:
        a = np.load(io.BytesIO(zlib.decompress(base64.b64decode(s, validate=True))), allow_pickle=False)
    except Exception:
        return None
    return a if isinstance(a, np.ndarray) and not a.dtype.hasobject else None


def _encode_npy_b64(a: np.ndarray) -> str:
    """The inverse, byte-compatible with ``ray.rllib.utils.serialization._serialize_ndarray``."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(a), allow_pickle=False)
    return base64.b64encode(zlib.compress(buf.getvalue())).decode("ascii")


def to_storable(obj: Any, state_name: str = "state", allow_pickle: bool = False) -> Any:
    """Convert an RLlib state into what ray_ckpt's formats store without pickle (lossless; see the
    module docstring). Raises UnsupportedTypeError naming ``state_name`` and the key path of the first
    object that has no safe representation (unless ``allow_pickle``: then it is left for pickle)."""

    def refuse(x: Any, path: list, why: str = "") -> UnsupportedTypeError:
        return UnsupportedTypeError(
            f"RLlib state {state_name!r}: unsupported object of type {type(x).__module__}."
            f"{type(x).__qualname__} at {_path_str(path)}{(' (' + why + ')') if why else ''}; "
            f"ray_ckpt stores tensors, numpy arrays, Arrow tables, JSON scalars and dicts/lists/tuples "
            f"of them without pickle. Pass allow_pickle=({state_name!r},) to make_callback / "
            f"restore_algorithm to store this state with pickle (loading it then runs code)")

    def conv(x: Any, path: list) -> Any:
        t = type(x)
        if x is None or t in (bool, int, float, str, bytes):
            return x
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject or x.dtype.fields is not None:
                if allow_pickle:
                    return x
                raise refuse(x, path, f"numpy dtype {x.dtype}")
            return x
        if isinstance(x, np.generic) and not isinstance(x, np.object_):
            return x
        if torch is not None and (isinstance(x, torch.Tensor) or t is torch.dtype):
            return x
        if pa is not None and isinstance(x, (pa.Table, pa.RecordBatch)):
            return x
        if isinstance(x, dict):
            keys_ok = all(type(k) in (str, int) for k in x) and not any(
                isinstance(k, str) and k.startswith(_MARK) for k in x)
            if not keys_ok:
                return {_ITEMS: [(conv(k, path + [k]), conv(v, path + [k])) for k, v in x.items()]}
            running_stat = "num_pushes" in x
            out = collections.OrderedDict() if t is collections.OrderedDict else {}
            for k, v in x.items():
                if running_stat and k in _RUNNING_STAT_ARRAYS and isinstance(v, str):
                    arr = _decode_npy_b64(v)
                    out[k] = {_NPY: arr} if arr is not None else v
                else:
                    out[k] = conv(v, path + [k])
            return out
        if t is list:
            return [conv(v, path + [i]) for i, v in enumerate(x)]
        if t is tuple:
            return tuple(conv(v, path + [i]) for i, v in enumerate(x))
        if t in (set, frozenset):
            return {_SET: [conv(v, path + [i]) for i, v in enumerate(x)], "frozen": t is frozenset}
        if isinstance(x, collections.deque):
            if allow_pickle:
                return x
            raise refuse(x, path, "a deque")
        if allow_pickle:
            return x
        raise refuse(x, path)

    try:
        return conv(obj, [])
    finally:
        conv = None  # noqa: F841 -- conv refers to itself: break the cycle so obj is not kept alive


def from_storable(obj: Any) -> Any:
    """The inverse of :func:`to_storable`."""
    t = type(obj)
    if t is dict or t is collections.OrderedDict:
        if len(obj) == 1 and _ITEMS in obj:
            return {from_storable(k): from_storable(v) for k, v in obj[_ITEMS]}
        if len(obj) == 1 and _NPY in obj:
            return _encode_npy_b64(obj[_NPY])
        if len(obj) == 2 and _SET in obj and "frozen" in obj:
            items = [from_storable(v) for v in obj[_SET]]
            return frozenset(items) if obj["frozen"] else set(items)
        out = collections.OrderedDict() if t is collections.OrderedDict else {}
        for k, v in obj.items():
            out[k] = from_storable(v)
        return out
    if t is list:
        return [from_storable(v) for v in obj]
    if t is tuple:
        return tuple(from_storable(v) for v in obj)
    return obj


def _deep_equal(a: Any, b: Any) -> bool:
    """Structural, bit-exact equality of two storable states (arrays compared by dtype, shape, bytes)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a2, b2 = np.asarray(a), np.asarray(b)
        return (a2.dtype == b2.dtype and a2.shape == b2.shape
                and np.ascontiguousarray(a2).tobytes() == np.ascontiguousarray(b2).tobytes())
    if torch is not None and isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _runner_module_state(runner: Any) -> Optional[Dict[str, Any]]:
    """{module id: {param: array}} of an env runner's module (a single-agent runner holds one RLModule,
    whose state is not keyed by module id; it is then keyed by DEFAULT_MODULE_ID, as the learner's)."""
    module = getattr(runner, "module", None)
    if module is None:
        return None
    st = module.get_state()
    if st and not all(isinstance(v, dict) for v in st.values()):
        st = {DEFAULT_MODULE_ID: st}
    return st


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


# ====================================================================== process / env RNG states
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
        gen = getattr(getattr(e, "unwrapped", e), "_np_random", None)
        out.append(gen.bit_generator.state if isinstance(gen, np.random.Generator) else None)
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


def _remote_runner_handles(group: Any) -> Dict[int, Any]:
    """{runner id: actor handle} of the remote env runners (RLlib has no public accessor)."""
    mgr = getattr(group, "_worker_manager", None)
    if mgr is None:
        return {}
    try:
        # every runner, healthy or not: a runner that cannot answer its snapshot is then reported
        # missing in the version (best-effort), instead of silently left out of it
        return dict(mgr.actors())
    except Exception as exc:  # pragma: no cover - RLlib internals changed
        log.warning("ray_ckpt: cannot list RLlib's remote env runners (%s); their best-effort RNG "
                       "states are not saved", exc)
        return {}


# ====================================================================== capture
def _learner_components(metrics: bool) -> List[str]:
    comps = [f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}", f"{COMPONENT_LEARNER}/{COMPONENT_OPTIMIZER}"]
    if metrics:
        comps.append(f"{COMPONENT_LEARNER}/{COMPONENT_METRICS_LOGGER}")
    return comps


def _connector_state(algorithm: Any) -> Optional[Dict[str, Any]]:
    if not getattr(algorithm.config, "is_online", True):
        return None
    runner = getattr(algorithm, "env_runner", None)
    if runner is not None:
        return runner.get_state(components=[COMPONENT_ENV_TO_MODULE_CONNECTOR,
                                            COMPONENT_MODULE_TO_ENV_CONNECTOR])
    state = {}
    for comp, attr in ((COMPONENT_ENV_TO_MODULE_CONNECTOR, "env_to_module_connector"),
                       (COMPONENT_MODULE_TO_ENV_CONNECTOR, "module_to_env_connector")):
        conn = getattr(algorithm, attr, None)
        if conn is not None:
            state[comp] = conn.get_state()
    return state


def capture_algorithm_state(algorithm: Any, *, rng: bool = True, metrics: bool = True,
                            allow_pickle: Iterable[str] = (),
                            errors: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The in-process states of one version, converted with :func:`to_storable`: ``policy``,
    ``optimizer``, ``connectors``, ``counters`` (+ ``rng``, ``metrics``). A critical state that cannot
    be converted raises; a best-effort one (``metrics``) is left out and its reason put in ``errors``."""
    pickled = set(allow_pickle)
    lg = algorithm.learner_group.get_state(components=_learner_components(metrics))[COMPONENT_LEARNER]
    out: Dict[str, Any] = {}
    out[POLICY] = to_storable(lg[COMPONENT_RL_MODULE], POLICY, POLICY in pickled)
    out[OPTIMIZER] = to_storable(lg[COMPONENT_OPTIMIZER], OPTIMIZER, OPTIMIZER in pickled)
    conn = _connector_state(algorithm)
    out[CONNECTORS] = to_storable(conn if conn is not None else {}, CONNECTORS, CONNECTORS in pickled)
    sampled = algorithm.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)
    out[COUNTERS] = {
        TRAINING_ITERATION: int(algorithm.iteration),
        WEIGHTS_SEQ_NO: int(lg.get(WEIGHTS_SEQ_NO, 0) or 0),
        NUM_ENV_STEPS_SAMPLED_LIFETIME: int(sampled or 0),
    }
    if rng:
        out[RNG] = to_storable(rng_state(), RNG)
    if metrics:
        try:
            out[METRICS] = to_storable({"algorithm": algorithm.metrics.get_state(),
                                        "learner": lg.get(COMPONENT_METRICS_LOGGER)},
                                       METRICS, METRICS in pickled)
        except UnsupportedTypeError as exc:
            if errors is None:
                raise
            errors[METRICS] = str(exc)
    return out


# ====================================================================== settings + callback
@dataclass
class CheckpointSettings:
    """What :class:`RayCkptCallback` saves and where.

    ``local_dir=None`` connects to an already created engine of ``run`` instead of creating one.
    ``every``: save when ``algorithm.iteration % every == 0``. ``on_busy``: what a save does when
    ``max_in_flight`` saves are still in flight ("skip": never block train(); "wait"; "queue").
    ``on_error``: a failed save (seen at the next iteration) raises SaveError out of train()
    ("raise") or is logged at ERROR level and counted ("warn"). ``env_runner_states``: save each
    remote env runner's RNG / env RNG states (best effort). ``allow_pickle``: names of states that
    may fall back to pickle. ``engine_options``: more ``CheckpointEngine.create`` options
    (critical_writers, keep_best, remote_options, max_in_flight, ...)."""

    run: str
    local_dir: Optional[str] = None
    remote_uri: Optional[str] = None
    every: int = 1
    keep_last: Optional[int] = None
    keep_every: Optional[int] = None
    on_busy: str = "skip"
    on_error: str = "raise"
    env_runner_states: bool = True
    rng: bool = True
    metrics: bool = True
    allow_pickle: Tuple[str, ...] = ()
    engine_options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            validate_name(self.run, "run name")
            OnBusy.parse(self.on_busy)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise InvalidArgumentError(f"every must be an integer >= 1, got {self.every!r}")
        if self.on_error not in ("raise", "warn"):
            raise InvalidArgumentError(f"on_error must be 'raise' or 'warn', got {self.on_error!r}")
        if isinstance(self.allow_pickle, str):
            self.allow_pickle = (self.allow_pickle,)
        self.allow_pickle = tuple(self.allow_pickle)
        self.engine_options = dict(self.engine_options or {})
        clash = {"run", "local_dir", "remote_uri", "keep_last", "keep_every"} & set(self.engine_options)
        if clash:
            raise InvalidArgumentError(f"engine_options must not repeat {sorted(clash)}: pass them directly")

    def engine(self) -> CheckpointEngine:
        if self.local_dir is None:
            return CheckpointEngine.connect(self.run)
        return CheckpointEngine.create(self.run, local_dir=self.local_dir, remote_uri=self.remote_uri,
                                       keep_last=self.keep_last, keep_every=self.keep_every,
                                       **self.engine_options)


class RayCkptCallback(RLlibCallback):
    """Saves the algorithm every ``settings.every`` iterations from ``on_train_result``.

    Construct it with the settings (``RayCkptCallback("run", local_dir=..., every=5)``, e.g. through
    ``functools.partial``) or use :func:`make_callback`, which binds them to a subclass. After each
    iteration ``result["ray_ckpt"]`` holds a summary (saves, skipped, failed, last save() call ms).
    Attributes for inspection: ``engine``, ``saves`` (iteration -> SaveHandle), ``save_call_ms``,
    ``skipped``, ``failures``."""

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
        self._pending: Dict[str, Any] = {}
        self._open: List[int] = []
        self._runner_names: set = set()
        self._last_step = -1

    # ------------------------------------------------------------------ RLlib hooks
    def on_algorithm_init(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        self._ensure_engine()

    def on_train_result(self, *, algorithm: Any, metrics_logger: Any = None, result: dict,
                        **kwargs: Any) -> None:
        self._collect(block=False)
        it = int(algorithm.iteration)
        if it % self.settings.every == 0:
            self.save(algorithm, it, result=result)
        if isinstance(result, dict):
            result["ray_ckpt"] = self.summary()

    # ------------------------------------------------------------------ API
    def save(self, algorithm: Any, iteration: Optional[int] = None, result: Optional[dict] = None) -> SaveHandle:
        """Capture the algorithm now and hand it to the engine (returns at once)."""
        t0 = time.perf_counter()
        eng = self._ensure_engine()
        it = int(algorithm.iteration) if iteration is None else int(iteration)
        s = self.settings
        if it <= self._last_step:
            # e.g. the algorithm was restored to an older version: versions are steps and only grow
            self.skipped.append(it)
            log.warning("ray_ckpt: iteration %d not saved: run %r already has version %d (the algorithm was "
                        "restored to an older version?); saving resumes after iteration %d",
                        it, s.run, self._last_step, self._last_step)
            return SaveHandle(eng, it, None, time.perf_counter() - t0, skipped=True)
        errors: Dict[str, str] = {}
        self._pending = capture_algorithm_state(algorithm, rng=s.rng, metrics=s.metrics,
                                                allow_pickle=s.allow_pickle, errors=errors)
        for name, why in errors.items():
            log.warning("ray_ckpt: iteration %d: best-effort state %r not saved: %s", it, name, why)
        try:
            self._sync_registrations(eng, algorithm)
            handle = eng.save(it, on_busy=s.on_busy, metrics=_save_metrics(result))
        finally:
            self._pending = {}
        ms = (time.perf_counter() - t0) * 1e3
        self.save_call_ms.append(ms)
        if handle.skipped:
            self.skipped.append(it)
            log.warning("ray_ckpt: iteration %d not saved: %d saves of run %r still in flight "
                        "(on_busy='skip')", it, len(self._open), s.run)
        else:
            self.saves[it] = handle
            self._open.append(it)
            self._last_step = it
        return handle

    def flush(self, timeout: Optional[float] = None) -> Dict[int, SaveResult]:
        """Wait until every save of this callback is committed locally; raises SaveError on a failure
        (whatever ``on_error`` says). Returns {iteration: SaveResult} of all saves so far."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for it in list(self._open):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.results[it] = self.saves[it].wait(left)
            except SaveError as exc:
                self.failures[it] = str(exc)
            self._open.remove(it)
        if self.failures:
            raise SaveError("; ".join(f"iteration {i}: {m}" for i, m in sorted(self.failures.items())))
        return dict(self.results)

    def summary(self) -> Dict[str, Any]:
        return {"saves": len(self.saves), "in_flight": len(self._open), "skipped": len(self.skipped),
                "failed": len(self.failures),
                "last_saved_iteration": max(self.saves) if self.saves else -1,
                "last_save_call_ms": self.save_call_ms[-1] if self.save_call_ms else float("nan")}

    # ------------------------------------------------------------------ internals
    def _ensure_engine(self) -> CheckpointEngine:
        if self.engine is None:
            self.engine = self.settings.engine()
            self._last_step = max((m.version for m in self.engine.list_checkpoints()), default=-1)
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
            eng.register(name, self._getter(name), strategy=strat,
                         allow_pickle=name in s.allow_pickle, replace=True)

    def _getter(self, name: str) -> Callable[[], Any]:
        def get() -> Any:
            try:
                return self._pending[name]
            except KeyError:
                raise SaveError(f"RLlib state {name!r} was not captured for this save") from None
        get.__name__ = f"rllib_{name}"
        return get

    def _sync_registrations(self, eng: CheckpointEngine, algorithm: Any) -> None:
        s = self.settings
        if s.metrics:
            if METRICS in self._pending and METRICS not in eng.registered:
                eng.register(METRICS, self._getter(METRICS), strategy=Strategy.BEST_EFFORT,
                             allow_pickle=METRICS in s.allow_pickle, replace=True)
            elif METRICS not in self._pending and METRICS in eng.registered:
                eng.unregister(METRICS)
        if not s.env_runner_states:
            return
        group = getattr(algorithm, "env_runner_group", None)
        handles = _remote_runner_handles(group) if group is not None else {}
        wanted = set()
        for i, h in handles.items():
            name = f"{ENV_RUNNER_PREFIX}{i}"
            wanted.add(name)
            h.__ray_call__.remote(_install_runner_provider)  # ordered before the snapshot below
            eng.register(name, h, strategy=Strategy.BEST_EFFORT, replace=True)
        for name in self._runner_names - wanted:
            if name in eng.registered:
                eng.unregister(name)
        self._runner_names = wanted

    def _collect(self, block: bool) -> None:
        for it in list(self._open):
            h = self.saves[it]
            if not block and not h.done():
                continue
            self._open.remove(it)
            try:
                self.results[it] = h.wait(None if block else 0)
            except SaveError as exc:
                self.failures[it] = str(exc)
                if self.settings.on_error == "raise":
                    raise SaveError(f"ray_ckpt: the save of iteration {it} (run {self.settings.run!r}) "
                                    f"failed: {exc}") from None
                log.error("ray_ckpt: the save of iteration %d (run %r) failed: %s", it, self.settings.run, exc)


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
    env_runner_states, rng, metrics, allow_pickle, engine_options). The settings are validated here."""
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


# ====================================================================== restore
@dataclass
class AlgorithmRestoreReport:
    """What :func:`restore_algorithm` did. ``states``: name -> "restored (local)" / "missing: why" /
    "not restored: why"; ``env_runners``: remote runner id -> "verified" (weights digest + connector
    state confirmed by the runner) or the problem; ``seconds``: the whole restore incl. the sync."""

    version: int
    iteration: int
    weights_seq_no: int
    states: Dict[str, str]
    env_runners: Dict[int, str]
    weights_digest: str
    seconds: float
    sync_seconds: float

    @property
    def verified(self) -> bool:
        return all(v == "verified" for v in self.env_runners.values())


def _resolve_engine(run: Union[str, CheckpointEngine], local_dir: Optional[str], remote_uri: Optional[str],
                    engine_options: Optional[Dict[str, Any]]) -> CheckpointEngine:
    if isinstance(run, CheckpointEngine):
        return run
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
    module_state = _runner_module_state(runner)
    digest = _weights_digest(module_state) if module_state is not None else ""
    conn = runner.get_state(components=[COMPONENT_ENV_TO_MODULE_CONNECTOR, COMPONENT_MODULE_TO_ENV_CONNECTOR])
    conn.pop(NUM_ENV_STEPS_SAMPLED_LIFETIME, None)
    return {"worker_index": idx, "digest": digest, "connectors": to_storable(conn, CONNECTORS, True),
            "weights_seq_no": getattr(runner, "_weights_seq_no", None), "rng": rng_note}


def restore_algorithm(algorithm: Any, run: Union[str, CheckpointEngine], version: int = -1, *,
                      local_dir: Optional[str] = None, remote_uri: Optional[str] = None,
                      engine_options: Optional[Dict[str, Any]] = None, timeout_s: float = 60.0,
                      strict: bool = True, restore_rng: bool = True, restore_env_runners: bool = True,
                      allow_pickle: Iterable[str] = ()) -> AlgorithmRestoreReport:
    """Bring ``algorithm`` (built from the same config) back to ``version`` (-1: the latest) of ``run``.

    ``run``: a run name (``local_dir`` given: get-or-create its engine; else connect to the running
    one) or a CheckpointEngine. Every state is read and verified before the algorithm is touched;
    with ``strict`` a missing critical state raises RestoreError and nothing changes. Then: learner
    weights + optimizer (stamped with a new weights_seq_no), connectors, iteration counter, metrics,
    RNGs; finally one synchronous ``set_state`` on every healthy remote env runner (weights from the
    learner, connector states, its own saved RNG states), bounded by ``timeout_s``, whose answers
    are checked: a runner that does not answer in time or holds other weights / connector states
    raises RestoreError (the algorithm is then restored but its runners are not to be trusted)."""
    t0 = time.perf_counter()
    engine = _resolve_engine(run, local_dir, remote_uri, engine_options)
    meta = _pick_version(engine, version)
    v = meta.version
    pickled = set(allow_pickle)
    states: Dict[str, str] = {}
    loaded: Dict[str, Any] = {}
    known = set(CRITICAL_STATES) | {METRICS}
    for name in meta.states:
        if name.startswith(ENV_RUNNER_PREFIX):
            if not restore_env_runners:
                states[name] = "not restored: restore_env_runners=False"
                continue
        elif name not in known:
            continue  # not one of ours
        try:
            loaded[name] = engine.load(v, name, allow_pickle=name in pickled)
            states[name] = "restored"
        except (RestoreError, CheckpointError) as exc:
            states[name] = f"missing: {exc}"
    for name in (POLICY, OPTIMIZER, CONNECTORS, COUNTERS):
        if name not in loaded:
            states.setdefault(name, f"missing: version {v} has no state {name!r}")
    missing_critical = [f"{n}: {states[n]}" for n in CRITICAL_STATES if n in states and n not in loaded]
    if missing_critical and strict:
        raise RestoreError(f"cannot restore version {v} of run {engine.run!r} into the algorithm; nothing "
                           f"was changed: " + " | ".join(missing_critical))
    for name in getattr(meta, "missing", ()) or ():
        states.setdefault(name, "missing: not written (or not yet: best-effort parts land after the commit)")

    # ---- learner: weights + optimizer, stamped with a weights_seq_no newer than anything out there
    lg = algorithm.learner_group
    counters = loaded.get(COUNTERS, {})
    current_seq = int(lg.get_state(components=f"{COMPONENT_LEARNER}/{WEIGHTS_SEQ_NO}")[COMPONENT_LEARNER]
                      .get(WEIGHTS_SEQ_NO, 0) or 0)
    new_seq = max(int(counters.get(WEIGHTS_SEQ_NO, 0) or 0), current_seq) + 1
    learner_state: Dict[str, Any] = {WEIGHTS_SEQ_NO: new_seq}
    if POLICY in loaded:
        learner_state[COMPONENT_RL_MODULE] = from_storable(loaded[POLICY])
    if OPTIMIZER in loaded:
        learner_state[COMPONENT_OPTIMIZER] = from_storable(loaded[OPTIMIZER])
    metrics = from_storable(loaded[METRICS]) if METRICS in loaded else None
    if metrics is not None and metrics.get("learner") is not None:
        learner_state[COMPONENT_METRICS_LOGGER] = metrics["learner"]
    lg.set_state({COMPONENT_LEARNER: learner_state})

    # ---- algorithm-side connectors, counters, metrics, RNG (all in this process)
    conn = from_storable(loaded[CONNECTORS]) if CONNECTORS in loaded else None
    sampled = counters.get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
    local_runner = getattr(algorithm, "env_runner", None)
    if conn is not None:
        if local_runner is not None:
            local_runner.set_state(conn)
        else:
            for comp, attr in ((COMPONENT_ENV_TO_MODULE_CONNECTOR, "env_to_module_connector"),
                               (COMPONENT_MODULE_TO_ENV_CONNECTOR, "module_to_env_connector")):
                if comp in conn and getattr(algorithm, attr, None) is not None:
                    getattr(algorithm, attr).set_state(conn[comp])
    algo_state: Dict[str, Any] = {}
    if TRAINING_ITERATION in counters:
        algo_state[TRAINING_ITERATION] = int(counters[TRAINING_ITERATION])
    if metrics is not None and metrics.get("algorithm") is not None:
        algo_state[COMPONENT_METRICS_LOGGER] = metrics["algorithm"]
    if algo_state:
        algorithm.set_state(algo_state)  # only these keys: no connector merge, no weight sync here
    if restore_rng and RNG in loaded:
        set_rng_state(from_storable(loaded[RNG]))
    elif RNG in loaded:
        states[RNG] = "not restored: restore_rng=False"

    # ---- weights (inference-only, as RLlib syncs them) + connectors to every env runner, verified
    lgw = lg.get_state(components=f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}",
                       inference_only=True)[COMPONENT_LEARNER]
    weights = lgw[COMPONENT_RL_MODULE]
    seq = int(lgw.get(WEIGHTS_SEQ_NO, new_seq))
    digest = _weights_digest(weights)
    if local_runner is not None and getattr(local_runner, "module", None) is not None:
        local_runner.set_state({COMPONENT_RL_MODULE: weights, WEIGHTS_SEQ_NO: seq})
    runner_states = {}
    for name, st in loaded.items():
        if name.startswith(ENV_RUNNER_PREFIX):
            try:
                runner_states[int(name[len(ENV_RUNNER_PREFIX):])] = st
            except ValueError:
                pass
    t_sync = time.perf_counter()
    env_runners: Dict[int, str] = {}
    groups = [("train", getattr(algorithm, "env_runner_group", None)),
              ("eval", getattr(algorithm, "eval_env_runner_group", None))]
    conn_expected = None
    if conn is not None:
        conn_expected = to_storable({k: v for k, v in conn.items() if k != NUM_ENV_STEPS_SAMPLED_LIFETIME},
                                    CONNECTORS, True)
    problems: List[str] = []
    weights_ref = ray.put(weights)
    for kind, group in groups:
        if group is None or not group.num_remote_env_runners():
            continue
        push: Dict[str, Any] = {COMPONENT_RL_MODULE: weights_ref, WEIGHTS_SEQ_NO: seq}
        if conn is not None:
            push.update({k: v for k, v in conn.items() if k != NUM_ENV_STEPS_SAMPLED_LIFETIME})
        if sampled is not None and kind == "train":
            push[NUM_ENV_STEPS_SAMPLED_LIFETIME] = int(sampled)
        payload = {"state": push, "runner_states": runner_states if (kind == "train" and restore_rng) else {}}
        expected = list(group.healthy_env_runner_ids())
        answers = group.foreach_env_runner(lambda r, p=payload: _apply_on_runner(r, p),
                                           local_env_runner=False, timeout_seconds=timeout_s)
        by_id = {a["worker_index"]: a for a in answers}
        for i in expected:
            key = i if kind == "train" else -i
            a = by_id.get(i)
            if a is None:
                env_runners[key] = f"no answer within {timeout_s}s"
            elif a["digest"] != digest:
                env_runners[key] = (f"holds other weights (its weights_seq_no {a['weights_seq_no']}, "
                                    f"pushed {seq})")
            elif conn_expected is not None and not _deep_equal(a["connectors"], conn_expected):
                env_runners[key] = "holds other connector states"
            else:
                env_runners[key] = "verified"
            if env_runners[key] != "verified":
                problems.append(f"{kind} env runner {i}: {env_runners[key]}")
        if kind == "train":
            for i in runner_states:
                if i not in by_id:
                    states[f"{ENV_RUNNER_PREFIX}{i}"] = "not restored: no such healthy env runner now"
        unhealthy = set(getattr(group, "_worker_manager").actor_ids()) - set(expected) \
            if hasattr(group, "_worker_manager") else set()
        for i in sorted(unhealthy):
            env_runners[i if kind == "train" else -i] = "unhealthy: RLlib syncs it from the learner when it is restored"
    sync_s = time.perf_counter() - t_sync
    if problems:
        raise RestoreError(f"version {v} of run {engine.run!r} was loaded into the learner, but the env runners "
                           f"could not be verified: " + "; ".join(problems))
    return AlgorithmRestoreReport(version=v, iteration=int(algorithm.iteration), weights_seq_no=seq,
                                  states=states, env_runners=env_runners, weights_digest=digest,
                                  seconds=time.perf_counter() - t0, sync_seconds=sync_s)


def env_runner_weights(algorithm: Any, timeout_s: float = 60.0) -> Dict[int, Dict[str, Any]]:
    """{remote runner id: {module id: {param: array}}} fetched from the remote env runners (for checks)."""
    answers = algorithm.env_runner_group.foreach_env_runner(
        lambda r: (r.worker_index, _runner_module_state(r)), local_env_runner=False, timeout_seconds=timeout_s)
    return dict(answers)
