"""Ray metrics of saves and restores reach the Prometheus endpoint of Ray's metrics agent."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


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
    eng = engine_factory(remote_uri=None)
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
