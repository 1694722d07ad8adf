"""The settings of :class:`~ray_ckpt.integrations.rllib.callback.RayCkptCallback`: what it saves,
where, and how it behaves when saves are busy or fail; checked when built (``make_callback``), so a
bad option fails before the Algorithm is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from ...client.engine import CheckpointEngine
from ...errors import InvalidArgumentError
from ...storage.layout import validate_name
from ...types import OnBusy
from .replay.algorithm import check_replay_strategy


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
    (critical_writers, keep_best, remote_options, max_in_flight, ...). ``resume``: when the
    Algorithm is built (``on_algorithm_init``) and the run already has a committed version, restore
    the latest one into it (:func:`restore_algorithm`; RNGs only with ``rng``) -- e.g. a Tune trial
    restarted by ``FailureConfig(max_failures=...)`` continues from it; a restore that fails raises
    out of the Algorithm's construction. ``resume_timeout_s``: that restore's bound on the env
    runner sync.

    Tune (:mod:`.tune`): ``per_trial`` (default True): inside a Tune trial the run is
    ``<run>-<trial_id>``, one run per trial (outside Tune: ``run`` as given); False: every trial
    uses ``run``. ``tune_checkpoints``: "pointer" (default): a Tune checkpoint (``Trainable.save``,
    PBT) is a small file naming a committed version, restored from ray_ckpt; "rllib": RLlib's own.
    ``stop_timeout_s``: how long ``algorithm.stop()`` (and a Tune checkpoint) waits for saves in
    flight before the callback's coordinator is shut down.

    ``replay_strategy``: how the algorithm's replay buffer is saved (:mod:`.replay`): "auto"
    (default: CRITICAL when the algorithm has a ``local_replay_buffer`` -- DQN, SAC, APPO --, nothing
    for on-policy ones), "critical", "best_effort" or "off"."""

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
    resume: bool = False
    resume_timeout_s: float = 60.0
    per_trial: bool = True
    tune_checkpoints: str = "pointer"
    stop_timeout_s: float = 60.0
    replay_strategy: str = "auto"

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
        if not isinstance(self.resume, bool):
            raise InvalidArgumentError(f"resume must be True or False, got {self.resume!r}")
        check_replay_strategy(self.replay_strategy)
        if not isinstance(self.per_trial, bool):
            raise InvalidArgumentError(f"per_trial must be True or False, got {self.per_trial!r}")
        if self.tune_checkpoints not in ("pointer", "rllib"):
            raise InvalidArgumentError(f"tune_checkpoints must be 'pointer' or 'rllib', got {self.tune_checkpoints!r}")
        if isinstance(self.stop_timeout_s, bool) or not isinstance(self.stop_timeout_s, (int, float)) \
                or not self.stop_timeout_s > 0:
            raise InvalidArgumentError(f"stop_timeout_s must be a number of seconds > 0, got {self.stop_timeout_s!r}")
        if isinstance(self.allow_pickle, str):
            self.allow_pickle = (self.allow_pickle,)
        self.allow_pickle = tuple(self.allow_pickle)
        self.engine_options = dict(self.engine_options or {})
        clash = {"run", "local_dir", "remote_uri", "keep_last", "keep_every"} & set(self.engine_options)
        if clash:
            raise InvalidArgumentError(f"engine_options must not repeat {sorted(clash)}: pass them directly")

    def engine(self, run: Optional[str] = None) -> CheckpointEngine:
        run = self.run if run is None else run
        if self.local_dir is None:
            return CheckpointEngine.connect(run)
        return CheckpointEngine.create(run, local_dir=self.local_dir, remote_uri=self.remote_uri,
                                       keep_last=self.keep_last, keep_every=self.keep_every,
                                       **self.engine_options)
