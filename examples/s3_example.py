"""ray_ckpt with its remote tier on S3 (or any S3-compatible store: MinIO, SeaweedFS, Ceph RGW).

A learner saves every step to the node-local tier and uploads every 2nd committed version to S3;
then its local copy is wiped (as on a fresh node after a preemption) and the state is restored from
S3, verified against the manifest's checksums.

    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
    python examples/s3_example.py --remote-uri s3://my-bucket/ckpt [--endpoint 127.0.0.1:8333]

``--endpoint`` (host:port, plain http) is for S3-compatible servers; without it pyarrow uses AWS
(region and credentials from the usual AWS_* variables).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import ray
import torch

import ray_ckpt as rc


@ray.remote(num_cpus=0.25)
class Learner:
    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed)

    def train(self):
        x = torch.randn(64, 8, generator=self.gen)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss)

    def ckpt_get_state(self, name):
        return self.model.state_dict() if name == "policy" else self.opt.state_dict()

    def ckpt_set_state(self, name, state):
        (self.model if name == "policy" else self.opt).load_state_dict(state)

    def weights(self):
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remote-uri", required=True, help="s3://bucket/prefix")
    ap.add_argument("--endpoint", default=None, help="host:port of an S3-compatible server (http)")
    ap.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    ap.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--run", default=f"s3-example-{int(time.time())}")
    args = ap.parse_args(argv)
    options = None
    if args.endpoint:
        options = {"endpoint_override": args.endpoint, "scheme": "http", "region": "us-east-1",
                   "access_key": args.access_key, "secret_key": args.secret_key}
    local = tempfile.mkdtemp(prefix="ray_ckpt_s3_example_")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        learner = Learner.remote(0)
        # two small states: one critical writer is plenty, and nothing is best-effort
        engine = rc.CheckpointEngine.create(args.run, local_dir=local, remote_uri=args.remote_uri,
                                            remote_options=options, remote_every=2, keep_last=2,
                                            remote_keep_last=3, critical_writers=1, best_effort_writers=0)
        engine.register("policy", learner)
        engine.register("optimizer", learner)
        handles = []
        for step in range(1, args.steps + 1):
            ray.get(learner.train.remote())
            handles.append(engine.save(step))
        last_uploaded = max(s for s in range(1, args.steps + 1) if s % 2 == 0)
        t0 = time.perf_counter()
        result = handles[last_uploaded - 1].wait(timeout=300, durability="remote")
        print(f"version {result.version} is durable on {args.remote_uri} "
              f"({result.bytes_written:,} bytes uploaded; waited {time.perf_counter() - t0:.2f}s)")
        for h in handles:  # every local commit, before listing
            h.wait(timeout=300)
        print("versions:", ", ".join(f"v{m.version}[{'+'.join(m.tiers)}]" for m in engine.list_checkpoints()))
        want = ray.get(learner.weights.remote())
        # a fresh node: the local tier is empty, the learner starts from scratch (its process
        # starts while the old engine shuts down)
        fresh = Learner.remote(1)
        engine.shutdown()
        shutil.rmtree(local)
        ray.kill(learner)
        learner = fresh
        engine = rc.CheckpointEngine.create(args.run, local_dir=local, remote_uri=args.remote_uri,
                                            remote_options=options, critical_writers=1, best_effort_writers=0)
        engine.register("policy", learner)
        engine.register("optimizer", learner)
        report = engine.restore(step=last_uploaded)
        print(report)
        for _ in range(args.steps - last_uploaded):  # replay the steps after the last uploaded version
            ray.get(learner.train.remote())
        got = ray.get(learner.weights.remote())
        same = all(torch.equal(want[k], got[k]) for k in want)
        print(f"restored from {', '.join(sorted({r.tier for r in report.states.values()}))}; "
              f"weights after replay bit-identical: {'yes' if same else 'no'}")
        engine.shutdown()
        return 0 if same and all(r.tier == "remote" for r in report.states.values()) else 1
    finally:
        shutil.rmtree(local, ignore_errors=True)
        if started:
            ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
