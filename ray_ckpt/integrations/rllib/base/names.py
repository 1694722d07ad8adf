"""The names one RLlib version is stored under in the engine, and the integration's logger."""
from __future__ import annotations

import logging

log = logging.getLogger("ray_ckpt.rllib")

POLICY = "policy"
OPTIMIZER = "optimizer"
CONNECTORS = "connectors"
COUNTERS = "counters"
RNG = "rng"
METRICS = "metrics"
ENV_RUNNER_PREFIX = "env_runner_"
REPLAY = "replay"            # before the journal: the buffer's rows (read by ray-ckpt migrate only)
REPLAY_META = "replay_meta"  # before the journal: everything else of it (read by ray-ckpt migrate only)
REPLAY_JOURNAL = "replay_journal"  # the buffer as a journal of what it received (:mod:`..replay`); CRITICAL by default

CRITICAL_STATES = (POLICY, OPTIMIZER, CONNECTORS, COUNTERS, RNG)

TRAINING_ITERATION = "training_iteration"
