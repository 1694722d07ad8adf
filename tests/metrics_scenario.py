"""Run by tests/test_metrics.py in its own process: a Ray instance with metrics export on a known
port, one save and one restore, then read ray_ckpt's metrics from the Prometheus endpoint."""
import os
import socket
import sys
import tempfile
import time
import urllib.request

import ray
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ray_ckpt as rc  # noqa: E402

WANT = ["ray_ray_ckpt_commits", "ray_ray_ckpt_bytes_written", "ray_ray_ckpt_save_latency_seconds",
        "ray_ray_ckpt_restore_latency_seconds", "ray_ray_ckpt_saves_in_flight"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    root = tempfile.mkdtemp(prefix="rc_metrics_")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500})
    try:
        model = torch.nn.Linear(8, 8)
        eng = rc.CheckpointEngine.create("metrics", local_dir=os.path.join(root, "local"),
                                         remote_uri="file://" + os.path.join(root, "remote"))
        eng.register("policy", model.state_dict, loader=model.load_state_dict)
        eng.save(1).wait(timeout=60, durability="remote")
        eng.restore()
        deadline = time.time() + 90
        text = ""
        while time.time() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                text = ""
            if all(w in text for w in WANT):
                break
            time.sleep(1)
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_ray_ckpt_")]
        print("\n".join(lines))
        missing = [w for w in WANT if w not in text]
        assert not missing, f"metrics not exported: {missing}"
        commits = [ln for ln in lines if ln.startswith("ray_ray_ckpt_commits") and 'tier="local"' in ln]
        assert commits and float(commits[0].rsplit(" ", 1)[1]) >= 1, commits
        eng.shutdown()
        print("METRICS OK")
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
