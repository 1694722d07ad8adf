"""ray_ckpt in an OpenRLHF / verl-style PPO trainer: sharded learner ranks push their own parts.

The shape of OpenRLHF's ``PPOTrainer`` (and verl's ``RayPPOTrainer``), shrunk to a toy that runs
in seconds on a laptop:

* the driver owns the loop and the prompt **dataloader** (its position -- epoch, samples consumed,
  shuffle seed -- is saved and restored exactly);
* an actor group of **2 learner ranks** trains the policy data-parallel, ZeRO-style: each rank
  holds the full module for forward/backward, but owns only half of the flat fp32 master
  parameters and the Adam moments of that half. Gradients are reduce-scattered (each rank averages
  the two ranks' gradients for its half) and the updated halves are all-gathered, all through Ray
  object refs passed from one rank to the other;
* a frozen **reference model** actor gives the KL term (saved RELOADABLE: written once, every later
  version's manifest points at the first file);
* **rollout** actors receive the new weights every step and sample responses; their sampling is
  seeded by (seed, step, worker), so they hold no state worth saving (like vLLM engines).

Checkpoints: every ``--save-every`` steps the driver calls ``engine.save(step)`` (reference model +
dataloader) and, once the coordinator has opened that version, each rank pushes its own parts with
``engine.submit(step, ...)`` from inside the actor: ``policy`` (the module's weights, replicated:
rank 0's copy is stored once and restored to every rank -- DeepSpeed's ``mp_rank_00_model_states``)
and ``optim_shard`` (each rank's fp32 master half + Adam state -- DeepSpeed's
``zero_pp_rank_<r>_..._optim_states``). A version commits when every part arrived. At
``--kill-at`` learner rank 1 is killed (Ray restarts it with fresh state), the group restores the
latest version and the run finishes; the final state is compared bit for bit with an uninterrupted
run with the same seeds, run alongside.

    python examples/openrlhf_style/train.py [--steps 20 --save-every 4 --kill-at 10]
    python examples/openrlhf_style/train.py --local-dir '/ckpt/{node_id}' --remote-uri s3://ray-ckpt/runs
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
import uuid
from typing import Dict, List, Optional

import numpy as np
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.checkpoint_io import read_manifest

OBS_DIM, HIDDEN, N_ACTIONS = 8, 32, 16
N_PROMPTS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 96, 16, 4
PPO_EPOCHS, CLIP, KL_COEF, LR = 2, 0.2, 0.05, 1e-2
WORLD_SIZE = 2

RESULTS: Dict[str, object] = {}  # figures of the last main() call (read by the tests)


def make_policy(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(OBS_DIM, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, N_ACTIONS))


def task(seed: int):
    """The prompts and the (hidden) reward table: reward(prompt, action) = (prompt @ W)[action]."""
    rng = np.random.default_rng(seed + 12345)
    return (rng.standard_normal((N_PROMPTS, OBS_DIM)).astype(np.float32),
            rng.standard_normal((OBS_DIM, N_ACTIONS)).astype(np.float32))


def logprobs(model: torch.nn.Module, obs, act) -> torch.Tensor:
    logits = model(torch.as_tensor(obs))
    return torch.log_softmax(logits, -1).gather(1, torch.as_tensor(act)[:, None])[:, 0]


# ----------------------------------------------------------------------------- dataloader (driver)
class PromptLoader:
    """Shuffled, epoch-based prompt batches whose exact position is a small JSON state."""

    def __init__(self, prompts: np.ndarray, batch_size: int, shuffle_seed: int):
        self.prompts = prompts
        self.batch_size = batch_size
        self.shuffle_seed = shuffle_seed
        self.epoch = 0
        self.consumed = 0         # samples consumed in the current epoch
        self.total_consumed = 0

    def next_batch(self) -> np.ndarray:
        if self.consumed + self.batch_size > len(self.prompts):  # drop_last, next epoch
            self.epoch += 1
            self.consumed = 0
        order = np.random.default_rng([self.shuffle_seed, self.epoch]).permutation(len(self.prompts))
        idx = order[self.consumed:self.consumed + self.batch_size]
        self.consumed += self.batch_size
        self.total_consumed += self.batch_size
        return self.prompts[idx]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "total_consumed": self.total_consumed,
                "shuffle_seed": self.shuffle_seed}

    def load_state_dict(self, state: dict) -> None:
        if state["shuffle_seed"] != self.shuffle_seed:
            raise ValueError("the checkpoint's dataloader was shuffled with another seed")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
        self.total_consumed = state["total_consumed"]


# ----------------------------------------------------------------------------- actors
@ray.remote(num_cpus=0.1)
class RolloutWorker:
    """Samples SAMPLES_PER_PROMPT responses per prompt with the newest weights (vLLM's role)."""

    def __init__(self, seed: int, worker: int):
        torch.set_num_threads(1)
        self.seed, self.worker = seed, worker
        self.model = make_policy(seed)
        self.reward_table = task(seed)[1]

    def generate(self, weights: np.ndarray, prompts: np.ndarray, step: int) -> dict:
        torch.nn.utils.vector_to_parameters(torch.tensor(weights), self.model.parameters())
        obs = np.repeat(prompts, SAMPLES_PER_PROMPT, axis=0)
        with torch.no_grad():
            probs = torch.softmax(self.model(torch.as_tensor(obs)), -1).double().numpy()
        rng = np.random.default_rng([self.seed, step, self.worker])  # stateless: nothing to save
        u = rng.random(len(obs))
        act = np.minimum((probs.cumsum(1) < u[:, None]).sum(1), N_ACTIONS - 1).astype(np.int64)
        with torch.no_grad():
            old_logp = logprobs(self.model, obs, act).numpy()
        reward = (obs @ self.reward_table)[np.arange(len(obs)), act].astype(np.float32)
        group = reward.reshape(-1, SAMPLES_PER_PROMPT)
        adv = ((group - group.mean(1, keepdims=True)) / (group.std(1, keepdims=True) + 1e-6)).reshape(-1)
        return {"obs": obs, "act": act, "old_logp": old_logp, "reward": reward, "adv": adv.astype(np.float32)}


@ray.remote(num_cpus=0.1)
class ReferenceModel:
    """The frozen initial policy, for the KL penalty (saved RELOADABLE: stored once)."""

    def __init__(self, seed: int):
        torch.set_num_threads(1)
        self.model = make_policy(seed)
        for p in self.model.parameters():
            p.requires_grad_(False)

    def logprobs(self, batch: dict) -> np.ndarray:
        with torch.no_grad():
            return logprobs(self.model, batch["obs"], batch["act"]).numpy()

    def ckpt_get_state(self, name):
        return self.model.state_dict()

    def ckpt_set_state(self, name, state):
        self.model.load_state_dict(state)


@ray.remote(num_cpus=0.25, max_restarts=2)
class LearnerRank:
    """One rank of the policy actor group (OpenRLHF's PolicyModelActor under DeepSpeed ZeRO-2)."""

    def __init__(self, run: str, rank: int, world_size: int, seed: int):
        torch.set_num_threads(1)
        self.run, self.rank = run, rank
        self.model = make_policy(seed)  # every rank starts from the same weights
        flat = torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()
        bounds = np.linspace(0, flat.numel(), world_size + 1).astype(int)
        self.lo, self.hi = int(bounds[rank]), int(bounds[rank + 1])
        self.master = torch.nn.Parameter(flat[self.lo:self.hi].clone())  # this rank's fp32 partition
        self.opt = torch.optim.Adam([self.master], lr=LR)
        self.engine: Optional[rc.CheckpointEngine] = None
        self.handles: List[rc.SaveHandle] = []
        self.metrics = {}

    # -- one PPO update: local grads -> reduce-scatter -> sharded Adam -> all-gather
    def compute_grads(self, batch: dict, ref_logp: np.ndarray) -> np.ndarray:
        self.model.zero_grad(set_to_none=True)
        logp = logprobs(self.model, batch["obs"], batch["act"])
        ratio = torch.exp(logp - torch.as_tensor(batch["old_logp"]))
        adv = torch.as_tensor(batch["adv"])
        pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
        kl = (logp - torch.as_tensor(ref_logp)).mean()
        (pg + KL_COEF * kl).backward()
        self.metrics = {"reward": float(batch["reward"].mean()), "kl": float(kl)}
        return torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]).numpy()

    def apply_grads(self, *grads: np.ndarray) -> np.ndarray:
        """Reduce-scatter: average every rank's gradient over this rank's partition only."""
        g = grads[0][self.lo:self.hi].copy()
        for other in grads[1:]:
            g += other[self.lo:self.hi]
        self.master.grad = torch.from_numpy(g / len(grads))
        self.opt.step()
        return self.master.detach().numpy().copy()

    def load_partitions(self, *parts: np.ndarray) -> None:
        """All-gather: every rank's updated partition into the full module."""
        torch.nn.utils.vector_to_parameters(torch.from_numpy(np.concatenate(parts)), self.model.parameters())

    def weights(self) -> np.ndarray:
        return torch.nn.utils.parameters_to_vector(self.model.parameters()).detach().numpy().copy()

    def get_metrics(self) -> dict:
        return self.metrics

    # -- checkpointing: the rank pushes its own parts (DeepSpeed save_checkpoint's place)
    def save_checkpoint(self, step: int) -> List[float]:
        """Push this rank's parts for ``step``; returns at once (ms spent in each submit call)."""
        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        ms = []
        for name, state in (("policy", self.model.state_dict()),
                            ("optim_shard", {"master": self.master.detach(), "adam": self.opt.state_dict(),
                                             "range": [self.lo, self.hi]})):
            t0 = time.perf_counter()
            self.handles.append(self.engine.submit(step, name, state, rank=self.rank))
            ms.append((time.perf_counter() - t0) * 1e3)
        self.handles = [h for h in self.handles if not h.done()]
        return ms

    def ckpt_get_state(self, name):  # used by engine.restore() only: the ranks push their saves
        raise NotImplementedError("rank states are pushed with submit()")

    def ckpt_set_state(self, name, state):
        if name == "policy":
            self.model.load_state_dict(state)
        elif name == "optim_shard":
            if list(state["range"]) != [self.lo, self.hi]:
                raise ValueError(f"rank {self.rank}: partition {state['range']} != {[self.lo, self.hi]}")
            with torch.no_grad():
                self.master.copy_(state["master"])
            self.opt.load_state_dict(state["adam"])

    def final_state(self) -> dict:
        return {"weights": {k: v.clone() for k, v in self.model.state_dict().items()},
                "master": self.master.detach().clone(),
                "adam": {k: v.clone() for k, v in self.opt.state_dict()["state"][0].items()}}

    def pid(self) -> int:
        return os.getpid()


# ----------------------------------------------------------------------------- the run
def wait_restarted(actor, old_pid: int, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if ray.get(actor.pid.remote(), timeout=10) != old_pid:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError("the killed rank was not restarted in time")


def wait_opened(engine: rc.CheckpointEngine, handle: rc.SaveHandle, timeout: float = 60.0) -> None:
    """Wait until the coordinator has opened the version of ``handle`` (usually one round trip).

    A version is opened by whichever call reaches the coordinator first; the driver's save() must
    be that one, or it is refused. Ray orders calls per caller, not across callers, so the ranks
    (other callers) are told to submit only once the version is known to be open."""
    deadline = time.monotonic() + timeout
    while handle.step not in engine.status()["in_flight"] and not handle.done():
        if time.monotonic() > deadline:
            raise rc.SaveError(f"version {handle.step} was not opened within {timeout}s")
        time.sleep(0.001)


def make_inference_actors(seed: int):
    """The rollout actors and the frozen reference model: stateless / frozen, so two runs with the
    same seed may share them (as jobs share an inference pool)."""
    return [RolloutWorker.remote(seed, i) for i in range(WORLD_SIZE)], ReferenceModel.remote(seed)


def train(run: str, local_dir: str, remote_uri: Optional[str], steps: int, save_every: int,
          kill_at: Optional[int] = None, seed: int = 0, quiet: bool = False, inference=None):
    engine = rc.CheckpointEngine.create(run, local_dir=local_dir, remote_uri=remote_uri, keep_last=3,
                                        critical_writers=1, best_effort_writers=0,  # tiny states
                                        max_in_flight=1)  # a save waits for the previous commit (rarely)
    ranks = [LearnerRank.remote(run, r, WORLD_SIZE, seed) for r in range(WORLD_SIZE)]
    rollouts, reference = inference or make_inference_actors(seed)
    loader = PromptLoader(task(seed)[0], PROMPTS_PER_STEP, shuffle_seed=seed)

    # driver-side states: saved by engine.save(step)
    engine.register("reference", reference, strategy=rc.Strategy.RELOADABLE)
    engine.register("dataloader", loader.state_dict, loader=loader.load_state_dict)
    # rank-pushed states: each rank calls engine.submit(step, name, state, rank=r) itself
    engine.register("policy", ranks, world_size=WORLD_SIZE, replicated=True)
    engine.register("optim_shard", ranks, world_size=WORLD_SIZE)

    st = {"save_ms": [], "open_ms": [], "submit_ms": [], "versions": {}, "restore_s": None, "restored": None}
    handles: List[rc.SaveHandle] = []      # saves not yet recorded
    not_uploaded: List[rc.SaveHandle] = []  # recorded, remote copy not yet confirmed
    submit_refs = []

    def collect(wait: bool) -> None:
        """Record each committed version's figures (bytes written, where the reference lives);
        with ``wait``, block until every save is committed locally and uploaded."""
        for h in list(handles):
            if not wait and not h.done():
                continue
            res = h.wait(timeout=120)  # local commit: bytes_written counts bytes actually written
            m = manifest(engine, res.version)
            ref_file = m.states["reference"].files["0"][0]
            st["versions"][res.version] = {"bytes": res.bytes_written, "reference_path": ref_file.path,
                                           "reference_bytes": ref_file.size}
            handles.remove(h)
            not_uploaded.append(h)
        if wait:
            for h in not_uploaded:
                h.wait(timeout=120, durability="remote")
            not_uploaded.clear()

    step = 0
    while step < steps:
        step += 1
        prompts = np.array_split(loader.next_batch(), WORLD_SIZE)
        weights = ranks[0].weights.remote()                      # broadcast to the rollout engines
        batches = [w.generate.remote(weights, p, step) for w, p in zip(rollouts, prompts)]
        ref_logp = [reference.logprobs.remote(b) for b in batches]
        for _ in range(PPO_EPOCHS):
            grads = [r.compute_grads.remote(b, lp) for r, b, lp in zip(ranks, batches, ref_logp)]
            parts = [r.apply_grads.remote(*grads) for r in ranks]   # reduce-scatter + sharded Adam
            for r in ranks:
                r.load_partitions.remote(*parts)                     # all-gather
        if step % save_every == 0:
            t0 = time.perf_counter()
            h = engine.save(step)                        # reference + dataloader; opens version `step`
            t1 = time.perf_counter()
            wait_opened(engine, h)
            st["save_ms"].append((t1 - t0) * 1e3)
            st["open_ms"].append((time.perf_counter() - t1) * 1e3)
            handles.append(h)
            submit_refs += [r.save_checkpoint.remote(step) for r in ranks]  # ranks push their parts
        metrics = ray.get(ranks[0].get_metrics.remote())  # the step's end (also paces the driver)
        collect(wait=False)
        if not quiet and step % 5 == 0:
            print(f"  step {step:3d}  mean reward {metrics['reward']:+.3f}  kl {metrics['kl']:.4f}")
        if kill_at is not None and step == kill_at:
            collect(wait=True)  # the run's latest version is durable before the preemption
            st["submit_ms"] += [ms for pair in ray.get(submit_refs) for ms in pair]
            submit_refs = []
            old_pid = ray.get(ranks[1].pid.remote())
            if not quiet:
                print(f"  step {step:3d}  preemption: killing learner rank 1")
            ray.kill(ranks[1], no_restart=False)
            wait_restarted(ranks[1], old_pid)
            t0 = time.perf_counter()
            report = engine.restore()
            st["restore_s"] = time.perf_counter() - t0
            st["restored"] = report
            step = report.step
            kill_at = None
            if not quiet:
                print(f"  restored version {report.version} (step {report.step}) in {st['restore_s']:.3f}s: "
                      + ", ".join(f"{n}={r.status}/{r.tier}" for n, r in sorted(report.states.items()))
                      + f"; dataloader at epoch {loader.epoch}, {loader.total_consumed} prompts consumed")
    st["submit_ms"] += [ms for pair in ray.get(submit_refs) for ms in pair]
    collect(wait=True)
    final = ray.get([r.final_state.remote() for r in ranks])
    final.append(loader.state_dict())
    engine.shutdown()
    for a in ranks + ([] if inference else rollouts + [reference]):
        ray.kill(a)
    return final, st


def manifest(engine: rc.CheckpointEngine, version: int):
    """A committed version's manifest, from this node's local tier or else the remote one."""
    tiers = [engine.config.local_tier(), engine.config.remote_tier()]
    for tier in [t for t in tiers if t is not None]:
        try:
            return read_manifest(tier, version)
        except (OSError, rc.CheckpointError):
            last = tier
    raise rc.RestoreError(f"no manifest of version {version} on {last}")


def identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=10, help="kill learner rank 1 after this step (0: never)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory); the local "
                    "tier is <dir>/{a,b}/local and the remote tier file://<dir>/{a,b}/remote unless given below")
    ap.add_argument("--local-dir", default=None, help="node-local tier; '{node_id}' is replaced per process "
                    "by the node's id (e.g. /ckpt/{node_id})")
    ap.add_argument("--remote-uri", default=None, help="remote tier, any pyarrow.fs URI (e.g. "
                    "s3://ray-ckpt/runs; S3 endpoint and keys from AWS_ENDPOINT_URL_S3 / AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY)")
    ap.add_argument("--run-prefix", default="openrlhf", help="run names are <prefix>-{a,b}-<random>")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.kill_at and not args.save_every <= args.kill_at < args.steps:
        ap.error("--kill-at must be at least --save-every (a version must exist) and below --steps")
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_openrlhf_")
    suffix = uuid.uuid4().hex[:6]
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS", "local") != "local":  # a cluster (docker/docker-compose.yml)
            ray.init()
        else:  # a private local instance (never another process's cluster)
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)

    def tiers(tag: str):
        local = args.local_dir or os.path.join(root, tag, "local")
        remote = args.remote_uri or "file://" + os.path.join(root, tag, "remote")
        return local, remote

    try:
        # the uninterrupted run (same seeds) goes alongside, in a thread. The runs share the rollout
        # actors and the frozen reference model (stateless / frozen: seeded per step, never trained);
        # each has its own learner ranks, dataloader and checkpoint run.
        inference = make_inference_actors(args.seed)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.perf_counter()
            fut = pool.submit(train, f"{args.run_prefix}-a-{suffix}", *tiers("a"), args.steps, args.save_every,
                              None, args.seed, True, inference)
            print(f"uninterrupted run: {args.steps} steps (alongside)")
            print(f"preempted run: {args.steps} steps, save every {args.save_every}, learner rank 1 killed "
                  f"at step {args.kill_at}" if args.kill_at else f"second run: {args.steps} steps, no preemption")
            got, st = train(f"{args.run_prefix}-b-{suffix}", *tiers("b"), args.steps, args.save_every,
                            args.kill_at or None, args.seed, False, inference)
            ref, _ = fut.result()
        for a in inference[0] + [inference[1]]:
            ray.kill(a)
        print(f"both runs done in {time.perf_counter() - t0:.1f} s")
    finally:
        if started:
            ray.shutdown()
    same = identical(ref, got)

    versions = st["versions"]
    first = min(versions)
    ref_home = versions[first]["reference_path"]
    ref_once = all(v["reference_path"] == ref_home for v in versions.values())
    rows = [("steps", str(args.steps)), ("saves", str(len(st["save_ms"]))),
            ("median save() call (driver)", f"{statistics.median(st['save_ms']):.2f} ms"),
            ("median wait for version open", f"{statistics.median(st['open_ms']):.2f} ms"),
            ("median submit() call (rank)", f"{statistics.median(st['submit_ms']):.2f} ms")]
    for v, info in sorted(versions.items()):
        where = "reference written" if info["reference_path"].startswith(f"v{v:012d}/") else \
            f"reference -> v{int(info['reference_path'][1:13])}"
        rows.append((f"bytes written v{v}", f"{info['bytes']:,} ({where})"))
    rep = st["restored"]
    rows += [("restore", f"v{rep.version} in {st['restore_s']:.3f} s" if rep else "-"),
             ("bit-identical", "yes" if same else "no")]
    print()
    kw = max(len(k) for k, _ in rows)
    vw = max(16, max(len(v) for _, v in rows))
    print("+-" + "-" * kw + "-+-" + "-" * vw + "-+")
    for k, v in rows:
        print(f"| {k:<{kw}} | {v:>{vw}} |")
    print("+-" + "-" * kw + "-+-" + "-" * vw + "-+")
    later = sorted(v for v in versions if v != first)
    print(f"reference model: {versions[first]['reference_bytes']:,} bytes written once (v{first}), "
          f"referenced by {', '.join(f'v{v}' for v in later) or 'no later version'}: "
          f"{'yes' if ref_once else 'NO'}")
    RESULTS.clear()
    RESULTS.update(identical=same, versions=versions, reference_once=ref_once,
                   restored_version=rep.version if rep else None, save_ms=st["save_ms"], open_ms=st["open_ms"],
                   submit_ms=st["submit_ms"], restore_s=st["restore_s"])
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
