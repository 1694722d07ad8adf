"""A Ray Train run's retention and its preemption notice, on a two-node ``ray.cluster_utils.Cluster``.

Run by tests/test_ray_train.py in its own process (the train function lives in ``__main__`` so Ray
ships it by value). Prints "RAY TRAIN PREEMPTION OK" and exits 0 when every check holds.

  1. retention: ``RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=2,
     checkpoint_score_attribute="score"))`` and a push every step: the run keeps the two best
     versions by score and the newest, every other one is deleted; each pointer Ray Train keeps
     carries the score of the step it points to (Ray Train ranks pointers as the run ranks versions).
  2. preemption: a push only every 1000 steps; at step 3 rank 0 drains its own node with Ray's
     ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`` (a deadline far away, so that nothing
     dies): within a few steps a report saves the step it is at, and a later report saves again once
     that version has committed off the drained node (the run's writers there are replaced); Ray
     Train's final checkpoint points at the newest, and each version's model equals the one trained
     to its step.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

import ray
from ray.cluster_utils import Cluster

T0 = time.monotonic()
SCORES = [3.0, 9.0, 1.0, 7.0, 2.0, 5.0]  # steps 1..6


def say(msg) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def digest(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def retention_func(config):
    import torch
    from ray_ckpt.integrations.ray_train import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    ckpt = Checkpointer(config["run"], local_dir=config["local"], every=1)
    ckpt.register("model", model, replicated=True)
    for step in range(1, len(SCORES) + 1):
        with torch.no_grad():
            model.module.weight.add_(float(step))
        ckpt.report({"score": SCORES[step - 1]}, step)
    ckpt.close()


def preemption_func(config):
    import torch
    import ray.train
    from ray_ckpt.integrations.committed import rank0_decides
    from ray_ckpt.integrations.ray_train import Checkpointer

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(config["run"], local_dir=config["local"], every=1000)
    ckpt.register("model", model, replicated=True)
    out = config["out"]
    for step in range(1, config["max_steps"] + 1):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            with open(os.path.join(out, f"model-{step}.json"), "w") as f:
                json.dump({"digest": digest(model)}, f)
        if step == 3 and rank == 0:  # the cloud's warning, as the autoscaler passes it on
            node = ray.get_runtime_context().get_node_id()
            cmd = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", config["address"],
                   "--node-id", node, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message",
                   "spot preemption (test)", "--deadline-remaining-seconds", "600"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            with open(os.path.join(out, "drained.json"), "w") as f:
                json.dump({"step": step, "node": node}, f)
        ckpt.report({"loss": loss.item()}, step)
        # the loop ends once two saves for the notice committed (rank 0 decides: every rank leaves together)
        if rank0_decides(rank == 0 and len(ckpt.engine.all_steps()) >= 2, ray.train.get_context().get_world_size()):
            break
        time.sleep(0.5)
    ckpt.close()


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_raytrain_preempt_")
    os.environ["OMP_NUM_THREADS"] = "1"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"spot": 4})
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", "OMP_NUM_THREADS": "1"}})
    try:
        import ray_ckpt as rc
        from ray.train import CheckpointConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        from ray_ckpt.integrations.committed import read_pointer

        def fit(name, func, checkpoint_config=None, **cfg):
            out = os.path.join(root, name)
            os.makedirs(out)
            cfg.update(run=f"rtp-{name}-{uuid.uuid4().hex[:6]}", local=os.path.join(root, "local", name), out=out,
                       address=cluster.address)
            trainer = TorchTrainer(func, train_loop_config=cfg,
                                   scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                                resources_per_worker={"CPU": 0.5, "spot": 1}),
                                   run_config=RunConfig(name=name, storage_path=os.path.join(root, "train"),
                                                        checkpoint_config=checkpoint_config))
            return cfg, trainer.fit(), out

        cfg, result, _ = fit("retention", retention_func,
                             CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"))
        engine = rc.CheckpointEngine.connect(cfg["run"])
        deadline = time.monotonic() + 60  # retention runs after each commit, in the background
        while (kept := {m.step: m.metrics.get("score") for m in engine.list_checkpoints()}) != {2: 9.0, 4: 7.0, 6: 5.0}:
            assert time.monotonic() < deadline, f"the run keeps {kept}, not the two best by score and the newest"
            time.sleep(0.2)
        listed = []
        for c, metrics in result.best_checkpoints:
            with c.as_directory() as d:
                step = read_pointer(d)["step"]
            assert metrics["score"] == SCORES[step - 1], (step, metrics)  # the score of the step pointed at
            listed.append(step)
        say(f"retention: the run keeps steps {sorted(kept)} (best two by score, and the newest); Ray Train keeps "
            f"pointers to steps {listed}, each scored by the step it points to")
        engine.shutdown(stop_coordinator=True)
        return run_preemption(fit, rc, read_pointer)
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_preemption(fit, rc, read_pointer) -> int:
    cfg, result, out = fit("preempted", preemption_func, max_steps=40)
    drained = json.load(open(os.path.join(out, "drained.json")))
    engine = rc.CheckpointEngine.connect(cfg["run"])
    steps = engine.all_steps()
    assert len(steps) >= 2, f"the notice's save, then another once it was safe; found versions {steps}"
    assert drained["step"] <= steps[0] <= drained["step"] + 20, (drained, steps)
    with result.checkpoint.as_directory() as d:
        assert read_pointer(d)["step"] == steps[-1], (read_pointer(d), steps)
    import torch

    for saved in steps:
        model = torch.nn.Linear(8, 2)
        model.load_state_dict({k.removeprefix("module."): v for k, v in engine.load("model", step=saved).items()})
        want = json.load(open(os.path.join(out, f"model-{saved}.json")))["digest"]
        assert digest(model) == want, f"the version saved at step {saved} for the notice is not the model of its step"
    say(f"preemption: node drained at step {drained['step']}; with a push every 1000 steps the reports saved "
        f"steps {steps} (each committed off the drained node before the next), and Ray Train's checkpoint points at "
        f"step {steps[-1]}")
    engine.shutdown(stop_coordinator=True)
    say("RAY TRAIN PREEMPTION OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
