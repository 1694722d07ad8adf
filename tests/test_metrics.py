"""Ray metrics of saves and restores reach the Prometheus endpoint of Ray's metrics agent, named by
Prometheus' conventions and documented (docs/operations.md) under the names a user scrapes."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ray_ckpt import metrics

HERE = os.path.dirname(os.path.abspath(__file__))
OPERATIONS = os.path.join(os.path.dirname(HERE), "docs", "operations.md")


def test_names_follow_prometheus_conventions():
    counters = {metrics.WRITTEN_BYTES, metrics.COMMITS, metrics.FAILURES, metrics.EVACUATED}
    for name in metrics.NAMES:
        assert re.fullmatch(r"ckpt_[a-z_]+", name), name  # registered; Ray's exporter adds "ray_"
        assert name.endswith("_total") == (name in counters), name  # counters, and only they
        if "latency" in name or "pause" in name or "timestamp" in name:
            assert name.endswith("_seconds"), name
        if "bytes" in name:
            assert name.endswith("_bytes_total"), name
    assert metrics.SCRAPED == tuple("ray_" + n for n in metrics.NAMES)


def test_docs_document_the_scraped_names():
    text = open(OPERATIONS, encoding="utf-8").read()
    missing = [n for n in metrics.SCRAPED if f"`{n}`" not in text]
    assert not missing, f"docs/operations.md does not name {missing}"
    documented = set(re.findall(r"`((?:ray_)*ckpt_[a-z_]+(?:_total|_seconds|_in_flight))`", text))
    wrong = {n for n in documented if n not in metrics.SCRAPED}  # a registered name, or one that is not ours
    assert not wrong, f"docs/operations.md names metrics that are not scraped as such: {sorted(wrong)}"
    assert all(n.startswith("ray_ckpt_") and not n.startswith("ray_ray_") for n in metrics.SCRAPED)


@pytest.mark.slow  # 20-35 s: starts a Ray of its own
@pytest.mark.timeout(300)
def test_metrics_are_exported():
    # its own process: metrics export is configured when Ray starts
    proc = subprocess.run([sys.executable, os.path.join(HERE, "metrics_scenario.py")],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and "METRICS OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_status_shows_in_flight_saves_and_pools(engine_factory):
    import torch

    import ray_ckpt as rc

    big = {"w": torch.randn(40 << 20 // 4)}
    eng = engine_factory(remote_uri=None, critical_writers=1)  # one writer process fewer to start
    eng.register("big", lambda: big, loader=lambda s: None)
    h = eng.save(1)
    st = eng.status()
    assert set(st) >= {"in_flight", "queued_bytes", "last_error", "commits", "failures"}
    assert set(st["queued_bytes"]) == {"critical", "best_effort"}
    h.wait(timeout=60)
    eng.register("bad", lambda: {"x": object()}, loader=lambda s: None, allow_pickle=False)
    with pytest.raises(rc.UnsupportedTypeError):
        eng.save(2)
    st = eng.status()
    assert st["commits"] == 1 and st["in_flight"] == {}

    # register() makes the run's metrics in the provider's process (about 10 ms of Ray metric
    # registration that the first save's pause carried before: benchmarks/overlap.py first vs tenth)
    import ray

    @ray.remote(num_cpus=0.1)
    class Holder:  # numpy, not torch: its process does not import torch (~3.5 CPU-s)
        def ckpt_get_state(self, name):
            return {"w": np.zeros(4)}

        def ckpt_set_state(self, name, state):
            pass

    def made(actor, run):
        from ray_ckpt import metrics as m
        return run in m._run_metrics

    holder = Holder.remote()
    assert not ray.get(holder.__ray_call__.remote(made, eng.config.run), timeout=60)
    eng.register("held", holder)
    assert ray.get(holder.__ray_call__.remote(made, eng.config.run), timeout=60)  # queued behind register's call
    ray.kill(holder)
