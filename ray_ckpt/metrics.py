"""Ray metrics (``ray.util.metrics``), exported by Ray's metrics agent for Prometheus.

Named by Prometheus' conventions: the unit last (``_seconds``, ``_bytes``), counters end in
``_total``. Ray's exporter puts its ``ray_`` prefix in front of every application metric, so the
names registered are ``ckpt_*`` and what a user scrapes is ``SCRAPED_PREFIX + name``
(``ray_ckpt_commits_total``): one ``ray_ckpt_`` prefix, not ``ray_ray_ckpt_``. :data:`SCRAPED`
lists them all. Recording never raises: a metrics problem must not fail a checkpoint.

| scraped name | type | labels | what |
| --- | --- | --- | --- |
| ``ray_ckpt_save_latency_seconds`` | histogram | run, tier | a save's arrival at the coordinator -> its commit on that tier |
| ``ray_ckpt_snapshot_pause_seconds`` | histogram | run, state | how long a save paused the process that holds a state (its snapshot into the object store) |
| ``ray_ckpt_restore_latency_seconds`` | histogram | run | one ``restore()`` |
| ``ray_ckpt_written_bytes_total`` | counter | run, tier | bytes of committed versions per tier |
| ``ray_ckpt_commits_total`` | counter | run, tier | versions committed per tier |
| ``ray_ckpt_failures_total`` | counter | run, kind | failed saves (``kind="save"``) and uploads (``"upload"``) |
| ``ray_ckpt_saves_in_flight`` | gauge | run | versions accepted and not settled |
| ``ray_ckpt_last_commit_timestamp_seconds`` | gauge | run, tier | unix time of the newest commit per tier |
| ``ray_ckpt_evacuated_versions_total`` | counter | run, outcome | versions a preemption notice copied away (``outcome="moved"``) or could not (``"lost"``) |
| ``ray_ckpt_preemption_deadline_timestamp_seconds`` | gauge | run | unix time of the deadline of the notice in force (0: none) |

Alert on "no checkpoint committed in 30 minutes":
``time() - max by (run, tier) (ray_ckpt_last_commit_timestamp_seconds) > 1800``.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger("ray_ckpt.metrics")

_LATENCY_BOUNDS = [0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600]
_PAUSE_BOUNDS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]

# the names registered with Ray; Ray's exporter adds SCRAPED_PREFIX in front of each
SAVE_LATENCY = "ckpt_save_latency_seconds"
SNAPSHOT_PAUSE = "ckpt_snapshot_pause_seconds"
RESTORE_LATENCY = "ckpt_restore_latency_seconds"
WRITTEN_BYTES = "ckpt_written_bytes_total"
COMMITS = "ckpt_commits_total"
FAILURES = "ckpt_failures_total"
SAVES_IN_FLIGHT = "ckpt_saves_in_flight"
LAST_COMMIT = "ckpt_last_commit_timestamp_seconds"
EVACUATED = "ckpt_evacuated_versions_total"
PREEMPTION_DEADLINE = "ckpt_preemption_deadline_timestamp_seconds"

SCRAPED_PREFIX = "ray_"
NAMES = (SAVE_LATENCY, SNAPSHOT_PAUSE, RESTORE_LATENCY, WRITTEN_BYTES, COMMITS, FAILURES, SAVES_IN_FLIGHT,
         LAST_COMMIT, EVACUATED, PREEMPTION_DEADLINE)
SCRAPED = tuple(SCRAPED_PREFIX + n for n in NAMES)


class Metrics:
    """The metrics of one run, recorded from the process that calls (coordinator, driver, actor)."""

    def __init__(self, run: str):
        self.run = run
        try:
            from ray.util.metrics import Counter, Gauge, Histogram

            self.save_latency = Histogram(SAVE_LATENCY, "Seconds from a save's arrival to its commit on a tier",
                                          boundaries=_LATENCY_BOUNDS, tag_keys=("run", "tier"))
            self.pause = Histogram(SNAPSHOT_PAUSE, "Seconds a save paused the process holding a state "
                                   "(its snapshot into Ray's object store)",
                                   boundaries=_PAUSE_BOUNDS, tag_keys=("run", "state"))
            self.restore_latency = Histogram(RESTORE_LATENCY, "Seconds a restore took",
                                             boundaries=_LATENCY_BOUNDS, tag_keys=("run",))
            self.bytes_written = Counter(WRITTEN_BYTES, "Bytes of committed versions written per tier",
                                         tag_keys=("run", "tier"))
            self.commits = Counter(COMMITS, "Versions committed per tier", tag_keys=("run", "tier"))
            self.failures = Counter(FAILURES, "Failed saves and uploads", tag_keys=("run", "kind"))
            self.in_flight = Gauge(SAVES_IN_FLIGHT, "Versions accepted but not settled", tag_keys=("run",))
            self.last_commit = Gauge(LAST_COMMIT, "Unix time of the newest commit per tier",
                                     tag_keys=("run", "tier"))
            self.evacuated_versions = Counter(EVACUATED, "Versions a preemption notice copied away or could not",
                                              tag_keys=("run", "outcome"))
            self.preemption_deadline = Gauge(PREEMPTION_DEADLINE, "Unix time of the deadline of the preemption "
                                             "notice in force (0: none)", tag_keys=("run",))
            self.enabled = True
        except Exception as exc:  # pragma: no cover - metrics are optional
            log.warning("ray metrics unavailable: %s", exc)
            self.enabled = False

    def _do(self, fn, *args, **tags) -> None:
        if not self.enabled:
            return
        try:
            fn(*args, tags={"run": self.run, **tags})
        except Exception as exc:  # pragma: no cover
            log.debug("metric not recorded: %s", exc)

    def committed(self, tier: str, seconds: float, nbytes: int, at: Optional[float] = None) -> None:
        """A version committed on ``tier`` ``seconds`` after its save arrived, ``nbytes`` written;
        ``at``: the commit's unix time (default: now)."""
        self._do(self.commits.inc, 1.0, tier=tier)
        self._do(self.save_latency.observe, seconds, tier=tier)
        self._do(self.bytes_written.inc, float(max(nbytes, 0)), tier=tier)
        self.last_committed(tier, time.time() if at is None else at)

    def last_committed(self, tier: str, at: float) -> None:
        """Set the newest commit's unix time on ``tier`` without counting a commit (e.g. from the
        catalogue after a coordinator restart, so the gauge does not read 'never')."""
        self._do(self.last_commit.set, float(at), tier=tier)

    def snapshot_pause(self, seconds: float, state: str = "all") -> None:
        """One save paused the process that holds ``state`` for ``seconds``."""
        self._do(self.pause.observe, max(float(seconds), 0.0), state=state)

    def failed(self, kind: str) -> None:
        self._do(self.failures.inc, 1.0, kind=kind)

    def set_in_flight(self, n: int) -> None:
        self._do(self.in_flight.set, float(n))

    def evacuated(self, outcome: str) -> None:
        """A version a preemption notice copied away (``"moved"``) or could not (``"lost"``)."""
        self._do(self.evacuated_versions.inc, 1.0, outcome=outcome)

    def preemption(self, deadline: Optional[float]) -> None:
        """The deadline of the notice in force (None: no notice; a drain without one: 0 as well)."""
        d = deadline if deadline is not None and deadline != float("inf") else 0.0
        self._do(self.preemption_deadline.set, float(d))

    def restored(self, seconds: float) -> None:
        self._do(self.restore_latency.observe, seconds)


_run_metrics: "dict[str, Metrics]" = {}


def for_run(run: str) -> Metrics:
    """This process's Metrics of ``run``, made once per run and process (the driver's restores, an
    actor's snapshot pauses). Making them registers 8 metrics with Ray, which takes a while: ``register()``
    calls this in the provider's process so that the first save's pause does not carry it."""
    m = _run_metrics.get(run)
    if m is None:
        if len(_run_metrics) >= 64:  # a long-lived process that served many runs: forget the oldest
            _run_metrics.pop(next(iter(_run_metrics)))
        m = _run_metrics[run] = Metrics(run)
    return m
