"""ray_ckpt as the checkpoint layer of a real Ray Train ``TorchTrainer`` (2 workers, gloo, DDP, a
``StatefulDataLoader`` per rank).

Run by tests/test_ray_train.py in its own process (the train function is defined here, in
``__main__``, so Ray ships it by value to the workers). Prints "RAY TRAIN OK" and exits 0 when
every check holds; an AssertionError otherwise.

  1. an uninterrupted run: 8 steps, a push every 2; Ray Train's final checkpoint is a ray_ckpt
     pointer to step 8, and every checkpoint Ray Train lists names a committed version;
  3. an FSDP2 model (AdamW) trained on 2 workers and resumed by a TorchTrainer of 3 workers: every
     full tensor of the model and the optimizer bit-equal to the 2-worker state at the saved step.
  2. the same run with worker rank 1 exiting right after its report of step 5 (FailureConfig
     max_failures=1): Ray Train restarts the group, restore() brings back the step its
     get_checkpoint() names (bit-equal to what was saved at that step), and the final model and
     optimizer are bit-equal to the uninterrupted run's (each step also trains on the next batch of
     a shuffled ``StatefulDataLoader``: a loader that restarted its epoch would change them).
"""
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid

import ray

T0 = time.monotonic()


def say(msg) -> None:
    print(f"[{time.monotonic() - T0:5.1f}s] {msg}", flush=True)


def digest(model, opt) -> str:
    import torch

    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update((v if torch.is_tensor(v) else torch.tensor(v)).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_func(config):
    import torch
    import ray.train
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader
    from ray_ckpt.integrations.ray_train import Checkpointer

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    # a shuffled StatefulDataLoader, one per rank: 10 batches an epoch, so the 8 steps stay in one epoch
    # (torchdata 0.11 shuffles the epochs after a resumed one differently from an uninterrupted run,
    # with or without ray_ckpt: its own state_dict / load_state_dict in one process do the same)
    loader = StatefulDataLoader(TensorDataset(torch.randn(40, 16, generator=torch.Generator().manual_seed(7))),
                                batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(rank))
    ckpt = Checkpointer(config["run"], local_dir=config["local"], remote_uri=config["remote"], every=2,
                        overlap=True)  # the copies overlap the next steps: still bit-exact
    ckpt.register("model", model, replicated=True)
    ckpt.register("optimizer", opt, replicated=True)
    ckpt.register("scheduler", sched, replicated=True)
    ckpt.register("loader", loader)
    out = config["out"]
    start = ckpt.restore()
    batches = iter(loader)  # after a restore: from the batch after the last one the saved step used
    if start is not None and rank == 0:
        with open(os.path.join(out, f"restored-{start}.json"), "w") as f:
            json.dump({"step": start, "digest": digest(model, opt), "lr": opt.param_groups[0]["lr"]}, f)
    for step in range((start or 0) + 1, config["steps"] + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        try:
            (batch,) = next(batches)
        except StopIteration:  # a new epoch (not reached in 8 steps)
            batches = iter(loader)
            (batch,) = next(batches)
        loss = ((model(x) - y) ** 2).mean() + 0.1 * model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and step % 2 == 0:
            with open(os.path.join(out, f"saved-{step}.json"), "w") as f:
                json.dump({"step": step, "digest": digest(model, opt), "lr": opt.param_groups[0]["lr"]}, f)
        ckpt.report({"loss": loss.item()}, step)
        marker = os.path.join(out, "killed")
        if config.get("kill_at") == step and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker dies after its report of this step
    ckpt.close()
    if rank == 0:
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"digest": digest(model, opt)}, f)


def full_digest(model, opt) -> str:
    """The digest of the full tensors of an FSDP2 model and its optimizer (collective)."""
    import torch
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(full(t).detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update(full(v if torch.is_tensor(v) else torch.tensor(v)).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def fsdp_func(config):
    import torch
    import ray.train
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from ray_ckpt.integrations.ray_train import Checkpointer

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(config["run"], local_dir=config["local"], remote_uri=config["remote"], every=2)
    ckpt.register("model", model)
    ckpt.register("optimizer", opt)
    start = ckpt.restore()
    out = config["out"]
    if start is not None:
        d = full_digest(model, opt)
        if rank == 0:
            with open(os.path.join(out, f"restored-{start}-on-{world}.json"), "w") as f:
                json.dump({"step": start, "digest": d}, f)
        ckpt.report({}, start)  # Ray Train wants a report from every worker
        return
    for step in range(1, config["steps"] + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 2 == 0:
            d = full_digest(model, opt)
            if rank == 0:
                with open(os.path.join(out, f"saved-{step}.json"), "w") as f:
                    json.dump({"step": step, "digest": d}, f)
        ckpt.report({"loss": loss.item()}, step)
    ckpt.close()


def fit(root: str, name: str, kill_at=None, func=None, workers: int = 2, run=None, steps: int = 8):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = os.path.join(root, name)
    os.makedirs(out)
    cfg = {"run": run or f"rt-{name}-{uuid.uuid4().hex[:6]}", "local": os.path.join(root, "local"),
           "remote": "file://" + os.path.join(root, "remote"), "out": out, "steps": steps, "kill_at": kill_at}
    trainer = TorchTrainer(func or train_func, train_loop_config=cfg,
                           scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                                        resources_per_worker={"CPU": 0.5}),
                           run_config=RunConfig(name=name, storage_path=os.path.join(root, "train"),
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    files = {f: json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.endswith(".json")}
    return cfg, result, files


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="rc_raytrain_")
    os.environ["OMP_NUM_THREADS"] = "1"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        import ray_ckpt as rc
        from ray_ckpt.integrations.committed import read_pointer

        cfg, result, files = fit(root, "plain")
        with result.checkpoint.as_directory() as d:
            pointer = read_pointer(d)
        assert pointer["run"] == cfg["run"] and pointer["step"] == 8, pointer
        engine = rc.CheckpointEngine.connect(cfg["run"])
        assert engine.all_steps() == [2, 4, 6, 8], engine.all_steps()
        for c, _metrics in result.best_checkpoints:
            with c.as_directory() as d:
                assert read_pointer(d)["step"] in engine.all_steps()
        say(f"uninterrupted: Ray Train's checkpoint points at step {pointer['step']}; versions {engine.all_steps()}")

        cfg2, result2, files2 = fit(root, "killed", kill_at=5)
        restored = [v for k, v in files2.items() if k.startswith("restored-")]
        assert len(restored) == 1, files2.keys()
        r = restored[0]
        saved = files2[f"saved-{r['step']}.json"]
        assert r["digest"] == saved["digest"] and r["lr"] == saved["lr"], (r, saved)
        assert files2["final.json"]["digest"] == files["final.json"]["digest"], \
            "the resumed run's final model and optimizer differ from the uninterrupted run's"
        say(f"worker killed after step 5: the restarted group restored step {r['step']} bit-exact and ended "
            f"bit-equal to the uninterrupted run")

        cfg3, _, files3 = fit(root, "fsdp2", func=fsdp_func, steps=4)
        _, _, files4 = fit(root, "fsdp3", func=fsdp_func, workers=3, run=cfg3["run"])
        restored = files4["restored-4-on-3.json"]
        assert restored["digest"] == files3["saved-4.json"]["digest"], (restored, files3)
        say("FSDP2 on 2 workers, resumed by 3: every full tensor of model and optimizer bit-equal at step 4")
        say("RAY TRAIN OK")
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
