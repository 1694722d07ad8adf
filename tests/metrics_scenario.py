"""Run by tests/test_metrics.py in its own process: a Ray instance with metrics export on a known
port, a save (to both tiers), a failed save and a restore, then read ray_ckpt's metrics from the
Prometheus endpoint under the names a user scrapes (Ray's exporter adds its ``ray_`` prefix)."""
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.request

import numpy as np
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ray_ckpt as rc  # noqa: E402
from ray_ckpt.metrics import for_run  # noqa: E402

# exactly as scraped: name -> Prometheus type
WANT = {
    "ray_ckpt_save_latency_seconds": "histogram",
    "ray_ckpt_snapshot_pause_seconds": "histogram",
    "ray_ckpt_restore_latency_seconds": "histogram",
    "ray_ckpt_written_bytes_total": "counter",
    "ray_ckpt_commits_total": "counter",
    "ray_ckpt_failures_total": "counter",
    "ray_ckpt_saves_in_flight": "gauge",
    "ray_ckpt_last_commit_timestamp_seconds": "gauge",
}


@ray.remote(num_cpus=0)
class Broken:
    def ckpt_get_state(self, name):
        raise RuntimeError("no state today")

    def ckpt_set_state(self, name, state):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def families(text: str) -> dict:
    """{scraped name: type} of ray_ckpt's metric families in a Prometheus text page."""
    return dict(re.findall(r"^# TYPE (ray_ckpt_\w+) (\w+)$", text, re.M))


def samples(text: str, name: str, **labels) -> list:
    out = []
    for ln in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", ln)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


def main() -> int:
    root = tempfile.mkdtemp(prefix="rc_metrics_")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        # a numpy state: neither its save nor its restore imports torch in this process (formats/tree.py
        # imports it at the first tensor leaf; checked 2026-12-01: no torch in sys.modules at the end)
        model = {"weight": np.ones((8, 8), np.float32), "bias": np.zeros(8, np.float32)}
        # one critical writer, no best-effort pool (nothing best-effort here): fewer processes to start
        eng = rc.CheckpointEngine.create("metrics", local_dir=os.path.join(root, "local"),
                                         remote_uri="file://" + os.path.join(root, "remote"),
                                         critical_writers=1, best_effort_writers=0)
        eng.register("policy", lambda: model, loader=model.update)
        t0 = time.time()
        eng.save(1).wait(timeout=60, durability="remote")
        broken = Broken.remote()
        eng.register("broken", broken)
        try:
            eng.save(2).wait(timeout=60)
            raise AssertionError("a save whose provider raises must fail")
        except rc.CheckpointError:
            pass
        eng.unregister("broken")
        eng.restore()
        # the learner pause is recorded where the snapshot is taken; recorded here too, so the
        # family is exported however the engine feeds it
        for_run("metrics").snapshot_pause(0.003, "policy")
        deadline = time.time() + 90
        text = ""
        while time.time() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                text = ""
            if set(WANT) <= set(families(text)) and samples(text, "ray_ckpt_commits_total", tier="remote"):
                break
            time.sleep(0.25)  # the agent reports every 500 ms (metrics_report_interval_ms)
        got = families(text)
        print("\n".join(f"{n} {t}" for n, t in sorted(got.items())))
        assert got == WANT, f"scraped families differ: got {got}, want {WANT}"
        for tier in ("local", "remote"):
            assert samples(text, "ray_ckpt_commits_total", run="metrics", tier=tier) == [1.0], tier
            assert samples(text, "ray_ckpt_written_bytes_total", run="metrics", tier=tier)[0] > 0, tier
            last = samples(text, "ray_ckpt_last_commit_timestamp_seconds", run="metrics", tier=tier)
            assert len(last) == 1 and t0 - 1 <= last[0] <= time.time(), (tier, last, t0)
            assert samples(text, "ray_ckpt_save_latency_seconds_count", run="metrics", tier=tier) == [1.0]
        assert samples(text, "ray_ckpt_failures_total", run="metrics", kind="save") == [1.0]
        assert samples(text, "ray_ckpt_restore_latency_seconds_count", run="metrics")[0] >= 1
        assert samples(text, "ray_ckpt_snapshot_pause_seconds_count", run="metrics", state="policy")[0] >= 1
        eng.shutdown()
        print("METRICS OK")
        return 0
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
