"""ray_ckpt demo: a small but real RL run that is preempted mid-way and resumes bit-identically.

A policy-gradient learner actor (torch MLP, Adam, its own RNG streams, an observation normaliser,
a replay buffer) learns CartPole (dynamics written in numpy) from two rollout actors. It saves
asynchronously every few steps; at one step the learner and a rollout actor are killed (a simulated
preemption: Ray restarts them with fresh state), the run restores the latest committed version
and finishes. The final weights are compared, bit for bit, with an uninterrupted run.

    ray-ckpt demo [--steps 30 --save-every 5 --kill-at 17 --dir DIR]
    python -m ray_ckpt.demo            (the same; examples/demo.py in a source checkout runs this module)

It ships inside the package, so an installed ray_ckpt runs it without the source tree.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import ray
import torch

import ray_ckpt as rc


# ----------------------------------------------------------------------------- environment
class CartPole:
    """Classic cart-pole balancing (Barto et al. 1983), vectorised over episodes in numpy."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.state = None

    def reset(self, n: int) -> np.ndarray:
        self.state = self.rng.uniform(-0.05, 0.05, size=(n, 4))
        return self.state.astype(np.float32)

    def step(self, action: np.ndarray):
        x, x_dot, th, th_dot = self.state.T
        force = np.where(action == 1, 10.0, -10.0)
        cos, sin = np.cos(th), np.sin(th)
        temp = (force + 0.05 * th_dot ** 2 * sin) / 1.1
        th_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * th_acc * cos / 1.1
        self.state = np.stack([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, th + 0.02 * th_dot,
                               th_dot + 0.02 * th_acc], axis=1)
        done = (np.abs(self.state[:, 0]) > 2.4) | (np.abs(self.state[:, 2]) > 12 * 2 * math.pi / 360)
        return self.state.astype(np.float32), done


def make_policy() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


# ----------------------------------------------------------------------------- actors
@ray.remote(num_cpus=0.25, max_restarts=2)
class RolloutWorker:
    def __init__(self, seed: int):
        torch.set_num_threads(1)
        self.rng = np.random.default_rng(seed)
        self.env = CartPole(self.rng)
        self.policy = make_policy()

    def set_policy(self, state):
        """The policy as the learner's last save holds it (engine.publish): read in place from the
        object store, no second copy made by the learner."""
        self.policy.load_state_dict(state)

    def set_norm(self, state):
        self.published_norm = (np.array(state["mean"]), np.array(state["var"]))

    def sample(self, weights_and_norm, episodes: int = 8, horizon: int = 200):
        if weights_and_norm is None:  # set by set_policy / set_norm from the last save
            mean, var = self.published_norm
        else:
            weights, (mean, var) = weights_and_norm
            self.policy.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        obs = self.env.reset(episodes)
        alive = np.ones(episodes, bool)
        traj_obs, traj_act, traj_alive = [], [], []
        for _ in range(horizon):
            with torch.no_grad():
                logits = self.policy(torch.as_tensor((obs - mean) / np.sqrt(var + 1e-8), dtype=torch.float32))
            p1 = torch.softmax(logits, -1)[:, 1].numpy()
            act = (self.rng.random(episodes) < p1).astype(np.int64)
            traj_obs.append(obs)
            traj_act.append(act)
            traj_alive.append(alive.copy())
            obs, done = self.env.step(act)
            alive &= ~done
            if not alive.any():
                break
        alive_m = np.array(traj_alive, dtype=np.float32)  # [T, E]
        returns = np.flip(np.cumsum(np.flip(alive_m, 0), 0), 0).copy()
        return {"obs": np.array(traj_obs), "act": np.array(traj_act), "ret": returns, "mask": alive_m}

    def ckpt_get_state(self, name):
        return {"rng": self.rng.bit_generator.state, "env": self.env.state}

    def ckpt_set_state(self, name, state):
        self.rng.bit_generator.state = state["rng"]
        self.env.rng = self.rng
        self.env.state = state["env"]

    def pid(self):
        return os.getpid()


@ray.remote(num_cpus=0.5, max_restarts=2)
class Learner:
    def __init__(self, seed: int):
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.policy = make_policy()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=5e-3)
        self.gen = torch.Generator().manual_seed(seed)           # minibatch shuffling
        self.norm = {"mean": np.zeros(4), "var": np.ones(4), "count": 1e-4}
        self.replay = pa.table({"obs": pa.array([], pa.list_(pa.float32(), 4)), "ret": pa.array([], pa.float32())})
        self.mean_return = 0.0

    def weights(self):
        return {k: v.numpy() for k, v in self.policy.state_dict().items()}, (self.norm["mean"], self.norm["var"])

    def train(self, batches) -> float:
        batches = ray.get(batches)
        obs = np.concatenate([b["obs"][b["mask"] > 0] for b in batches])
        act = np.concatenate([b["act"][b["mask"] > 0] for b in batches])
        ret = np.concatenate([b["ret"][b["mask"] > 0] for b in batches])
        # running observation normaliser (Chan et al. parallel variance)
        bm, bv, bc = obs.mean(0), obs.var(0), len(obs)
        m, v, c = self.norm["mean"], self.norm["var"], self.norm["count"]
        d, tot = bm - m, c + bc
        self.norm = {"mean": m + d * bc / tot, "var": (v * c + bv * bc + d ** 2 * c * bc / tot) / tot, "count": tot}
        x = torch.as_tensor((obs - self.norm["mean"]) / np.sqrt(self.norm["var"] + 1e-8), dtype=torch.float32)
        adv = torch.as_tensor(ret - ret.mean(), dtype=torch.float32) / (float(ret.std()) + 1e-8)
        a = torch.as_tensor(act)
        for idx in torch.randperm(len(x), generator=self.gen).split(1024):
            logp = torch.log_softmax(self.policy(x[idx]), -1).gather(1, a[idx, None])[:, 0]
            loss = -(logp * adv[idx]).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        recent = pa.table({"obs": pa.FixedSizeListArray.from_arrays(pa.array(obs.reshape(-1)), 4),
                           "ret": pa.array(ret.astype(np.float32))})
        self.replay = pa.concat_tables([self.replay, recent]).slice(max(0, self.replay.num_rows + len(obs) - 4096))
        self.mean_return = float(np.mean([b["mask"].sum(0).mean() for b in batches]))
        return self.mean_return

    def ckpt_get_state(self, name):
        return {"policy": lambda: self.policy.state_dict(),
                "optimizer": lambda: self.opt.state_dict(),
                "rng": lambda: rc.rng_state(generators={"shuffle": self.gen}),
                "obs_norm": lambda: dict(self.norm),
                "replay": lambda: {"transitions": self.replay}}[name]()

    def ckpt_set_state(self, name, state):
        if name == "policy":
            self.policy.load_state_dict(state)
        elif name == "optimizer":
            self.opt.load_state_dict(state)
        elif name == "rng":
            rc.set_rng_state(state, generators={"shuffle": self.gen})
        elif name == "obs_norm":
            self.norm = dict(state)
        elif name == "replay":
            self.replay = state["transitions"]

    def final_weights(self):
        return {k: v.clone() for k, v in self.policy.state_dict().items()}

    def pid(self):
        return os.getpid()


# ----------------------------------------------------------------------------- the run
def wait_restarted(actor, old_pid, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != old_pid:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError("actor was not restarted in time")


def train(run: str, root: str, steps: int, save_every: int, kill_at=None, seed: int = 0, quiet=False):
    learner = Learner.remote(seed)
    workers = [RolloutWorker.remote(seed * 100 + i) for i in range(2)]
    engine = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, "local"),
                                        remote_uri="file://" + os.path.join(root, "remote"), keep_last=3)
    for name in ("policy", "optimizer", "rng", "obs_norm"):
        engine.register(name, learner, strategy=rc.Strategy.CRITICAL)
    engine.register("replay", learner, strategy=rc.Strategy.BEST_EFFORT)
    for i, w in enumerate(workers):
        engine.register(f"rollout{i}", w, strategy=rc.Strategy.CRITICAL)
    stats = {"save_ms": [], "bytes": 0, "saves": 0, "restore_s": None, "report": None, "published": 0}
    handles = []
    step = 0
    published = False
    while step < steps:
        step += 1
        # after a save, the rollout workers already hold its policy (engine.publish): the learner
        # does not copy its weights out a second time for them
        weights = None if published else learner.weights.remote()
        batches = [w.sample.remote(weights) for w in workers]
        ret = learner.train.remote(batches)
        published = False
        if step % save_every == 0:
            t0 = time.perf_counter()
            handles.append(engine.save(step))
            stats["save_ms"].append((time.perf_counter() - t0) * 1e3)
            stats["saves"] += 1
            engine.publish("policy", to=workers, method="set_policy")
            engine.publish("obs_norm", to=workers, method="set_norm")
            published = True
            stats["published"] += 1
        if not quiet and step % 5 == 0:
            print(f"  step {step:3d}  mean episode length {ray.get(ret):6.1f}")
        if kill_at is not None and step == kill_at:
            ray.get(ret)
            for h in handles:
                stats["bytes"] += h.wait(timeout=120, durability="remote").bytes_written
            handles = []
            pids = ray.get([learner.pid.remote(), workers[0].pid.remote()])
            print(f"  step {step:3d}  preemption: killing the learner and rollout worker 0") if not quiet else None
            ray.kill(learner, no_restart=False)
            ray.kill(workers[0], no_restart=False)
            wait_restarted(learner, pids[0])
            wait_restarted(workers[0], pids[1])
            t0 = time.perf_counter()
            report = engine.restore()
            stats["restore_s"] = time.perf_counter() - t0
            stats["report"] = report
            step = report.step
            kill_at = None
            published = False  # a restarted rollout worker holds no published policy
            if not quiet:
                print(f"  restored version {report.version} (step {report.step}) in {stats['restore_s']:.3f}s: "
                      + ", ".join(f"{n}={r.status}/{r.tier}" for n, r in sorted(report.states.items())))
    ray.get(ret)
    for h in handles:
        stats["bytes"] += h.wait(timeout=120, durability="remote").bytes_written
    final = ray.get(learner.final_weights.remote())
    engine.shutdown()
    for a in [learner] + workers:
        ray.kill(a)
    return final, stats


def main(argv=None, prog: str = "ray-ckpt demo") -> int:
    from .demo_options import parser  # one declaration of the demo's options, with their help

    args = parser(prog).parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_demo_")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(f"uninterrupted run: {args.steps} steps")
        ref, _ = train("demo-reference", os.path.join(root, "a"), args.steps, args.save_every, None, quiet=True)
        print(f"preempted run: {args.steps} steps, save every {args.save_every}, preemption at step {args.kill_at}")
        got, st = train("demo-preempted", os.path.join(root, "b"), args.steps, args.save_every, args.kill_at)
    finally:
        if started:
            ray.shutdown()
    same = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    rows = [("steps", str(args.steps)), ("saves", str(st["saves"])),
            ("median save() call", f"{statistics.median(st['save_ms']):.2f} ms"),
            ("bytes written", f"{st['bytes']:,}"),
            ("weights sent from saves", f"{st['published']} of {args.steps} steps"),
            ("restore time", f"{st['restore_s']:.3f} s" if st["restore_s"] is not None else "-"),
            ("bit-identical", "yes" if same else "no")]
    print()
    w = max(len(k) for k, _ in rows)
    print("+-" + "-" * w + "-+-" + "-" * 16 + "-+")
    for k, v in rows:
        print(f"| {k:<{w}} | {v:>16} |")
    print("+-" + "-" * w + "-+-" + "-" * 16 + "-+")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
