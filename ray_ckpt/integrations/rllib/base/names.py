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
REPLAY = "replay"            # the replay buffer's rows (the replay package); CRITICAL for off-policy by default
REPLAY_META = "replay_meta"  # everything else of it (priorities, counters, rng, episode metadata)
REPLAY_JOURNAL = "replay_journal"  # the buffer as a journal of what it received (the journal package, format /6)

CRITICAL_STATES = (POLICY, OPTIMIZER, CONNECTORS, COUNTERS, RNG)

TRAINING_ITERATION = "training_iteration"
