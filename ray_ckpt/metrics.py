"""Ray metrics (``ray.util.metrics``), exported by Ray's metrics agent for Prometheus.

Names as Prometheus shows them carry Ray's ``ray_`` prefix, e.g. ``ray_ray_ckpt_commits_total``.
Recording never raises: a metrics problem must not fail a checkpoint.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("ray_ckpt.metrics")

_LATENCY_BOUNDS = [0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600]


class Metrics:
    def __init__(self, run: str):
        self.run = run
        try:
            from ray.util.metrics import Counter, Gauge, Histogram

            self.save_latency = Histogram("ray_ckpt_save_latency_seconds",
                                          "Seconds from a save's arrival to its commit on a tier",
                                          boundaries=_LATENCY_BOUNDS, tag_keys=("run", "tier"))
            self.restore_latency = Histogram("ray_ckpt_restore_latency_seconds", "Seconds a restore took",
                                             boundaries=_LATENCY_BOUNDS, tag_keys=("run",))
            self.bytes_written = Counter("ray_ckpt_bytes_written", "Bytes written per tier",
                                         tag_keys=("run", "tier"))
            self.commits = Counter("ray_ckpt_commits", "Versions committed per tier", tag_keys=("run", "tier"))
            self.failures = Counter("ray_ckpt_failures", "Failed saves and uploads", tag_keys=("run", "kind"))
            self.in_flight = Gauge("ray_ckpt_saves_in_flight", "Versions accepted but not settled",
                                   tag_keys=("run",))
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

    def committed(self, tier: str, seconds: float, nbytes: int) -> None:
        self._do(self.commits.inc, 1.0, tier=tier)
        self._do(self.save_latency.observe, seconds, tier=tier)
        self._do(self.bytes_written.inc, float(max(nbytes, 0)), tier=tier)

    def failed(self, kind: str) -> None:
        self._do(self.failures.inc, 1.0, kind=kind)

    def set_in_flight(self, n: int) -> None:
        self._do(self.in_flight.set, float(n))

    def restored(self, seconds: float) -> None:
        self._do(self.restore_latency.observe, seconds)


_driver_metrics: Optional[Metrics] = None


def for_run(run: str) -> Metrics:
    global _driver_metrics
    if _driver_metrics is None or _driver_metrics.run != run:
        _driver_metrics = Metrics(run)
    return _driver_metrics
