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
``on_algorithm_init``, so the first ``train()`` does not pay for the coordinator's start-up. With
``resume=True`` it also restores the run's latest version there, so an Algorithm rebuilt after a
failure (a Tune trial retried by ``FailureConfig(max_failures=...)``) continues from it.

Restoring -- :func:`restore_algorithm` (a fresh or a running Algorithm built from the same config)
reads a whole version before touching the algorithm, restores learner, connectors, counters,
metrics and RNGs, and pushes weights + connector states to every remote env runner, verified.

The package, by concern:

=================== ===============================================================================
module              holds
=================== ===============================================================================
``base/``           what every other module and ``replay/`` stand on (so ``replay/`` imports nothing of
                    the modules that import it): ``names`` (the state names of a version, the logger),
                    ``conversion`` (RLlib state <-> storable state: :func:`to_storable`,
                    :func:`from_storable`), ``learner_params`` (optimizer parameters outside the
                    learner's modules), ``_rllib_internals`` (every private / undocumented RLlib
                    attribute relied on, and a check of them)
``replay/``         off-policy replay buffers <-> storable states (see its own docstring)
``capture``         what one version holds, read from an Algorithm (:func:`capture_algorithm_state`)
``callback``        :class:`RayCkptCallback`, :func:`make_callback`, :func:`find_callback`,
                    :func:`wait_for_saves`
``settings``        :class:`CheckpointSettings`, the callback's options, checked when built
``restore``         :func:`restore_algorithm`, step by step; :class:`AlgorithmRestoreReport`
``env_runners``     env runner state (their RNGs) and the restore's verified push to every runner
``tune``            one run per Tune trial (``<run>-<trial_id>``), Tune checkpoints that name a version
                    (PBT), the Algorithm's ``stop()`` (flush, then stop the callback's coordinator)
``learners``        remote learners: states captured in the first learner; verified push into each
=================== ===============================================================================
"""
from __future__ import annotations

import ray

try:
    import ray.rllib.callbacks.callbacks  # noqa: F401
    import ray.rllib.core  # noqa: F401
    import ray.rllib.utils.metrics  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised only without ray[rllib]
    raise ImportError(
        "ray_ckpt.integrations.rllib needs RLlib and its dependencies (gymnasium, ...): "
        f'pip install "ray-ckpt[rllib]" (or "ray[rllib]=={ray.__version__}"); {_exc}') from None

from .callback import RayCkptCallback, find_callback, make_callback, wait_for_saves  # noqa: E402
from .capture import capture_algorithm_state  # noqa: E402
from .settings import CheckpointSettings  # noqa: E402
from .base.conversion import from_storable, to_storable  # noqa: E402
from .env_runners import env_runner_weights  # noqa: E402
from .base.names import (CONNECTORS, COUNTERS, CRITICAL_STATES, ENV_RUNNER_PREFIX, METRICS,  # noqa: E402,F401
                    OPTIMIZER, POLICY, RNG, TRAINING_ITERATION, log)
from .restore import AlgorithmRestoreReport, restore_algorithm  # noqa: E402

__all__ = [
    "CheckpointSettings", "RayCkptCallback", "make_callback", "restore_algorithm",
    "AlgorithmRestoreReport", "capture_algorithm_state", "find_callback", "wait_for_saves",
    "to_storable", "from_storable", "env_runner_weights",
]
