"""ray_ckpt in an OpenRLHF / verl-style PPO trainer: FSDP2 learner ranks push DTensor state, and the
run resumes on a different number of ranks.

The shape of OpenRLHF's ``PPOTrainer`` (and verl's ``RayPPOTrainer``), shrunk to a toy that runs
in seconds on a laptop:

* the driver owns the loop and the prompt **dataloader** (its position -- epoch, samples consumed,
  shuffle seed -- is saved and restored exactly);
* an actor group of ``--ranks`` learner ranks (default 2) joined in a **gloo process group** trains
  the policy with **FSDP2** (``torch.distributed.fsdp.fully_shard``: each rank holds a shard of
  every parameter, gradients are reduce-scattered, parameters all-gathered for forward/backward)
  and **AdamW** (its moments are DTensors sharded like the parameters) -- verl's FSDP2 workers,
  OpenRLHF's ZeRO-3 in spirit;
* a frozen **reference model** actor gives the KL term (saved RELOADABLE: written once, every later
  version's manifest points at the first file);
* **rollout** actors receive the new weights every step and sample responses; their sampling is
  seeded by (seed, step, worker), so they hold no state worth saving (like vLLM engines).

Checkpoints: every ``--save-every`` steps the driver calls ``engine.save(step)`` (reference model +
dataloader) and, once the coordinator has opened that version, each rank pushes its own shards
with ``engine.submit(step, ...)`` from inside the actor: ``policy`` (the FSDP2 model's state dict)
and ``optim`` (AdamW's), both holding DTensors as they are, via
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``get_optimizer_state_dict``.
Each rank writes only its local shards; the manifest records where each chunk sits in the global
tensor. A version commits when every rank's part arrived.

At ``--kill-at`` learner rank 1 is killed. A gloo group cannot lose a member, so the whole learner
group goes (as a preempted job does) and comes back on ``--resume-ranks`` ranks (default 3: the
run reshards from 2 to 3 ranks, unevenly). The driver restores the reference model and the
dataloader with ``engine.restore()``; each new rank fills a freshly built FSDP2 model and AdamW with
``engine.load_into`` (each rank reads only the byte ranges of its new shards). Right after the
restore every parameter's and both AdamW moments' full tensor is compared bit for bit with what the
old group held when it saved that version; the run then finishes on the new group.

    python examples/openrlhf_style/train.py [--steps 20 --save-every 4 --kill-at 10 --ranks 2 --resume-ranks 3]
    python examples/openrlhf_style/train.py --local-dir '/ckpt/{node_id}' --remote-uri s3://ray-ckpt/runs

``--backend deepspeed`` runs the same preemption with OpenRLHF's own DeepSpeed strategy instead
(ZeRO-1/2/3, ``save_ckpt`` / ``load_ckpt`` through ray_ckpt): see ``deepspeed_backend.py``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from typing import Dict, List, Optional

import numpy as np
import ray
import torch

import ray_ckpt as rc
from ray_ckpt.storage.checkpoint_io import read_manifest

OBS_DIM, HIDDEN, N_ACTIONS = 8, 30, 16  # HIDDEN 30: uneven shards on 4 ranks, even on 2 and 3
N_PROMPTS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 96, 16, 4
PPO_EPOCHS, CLIP, KL_COEF, LR, WEIGHT_DECAY = 2, 0.2, 0.05, 1e-2, 0.01
N_ROLLOUT = 2  # rollout actors by default (independent of the number of learner ranks)

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


@ray.remote(num_cpus=0.1)
class LearnerRank:
    """One rank of the policy actor group (verl's FSDP2 actor worker, OpenRLHF's PolicyModelActor)."""

    def __init__(self, run: str, rank: int, world_size: int, seed: int):
        torch.set_num_threads(1)
        self.run, self.rank, self.world = run, rank, world_size
        self.seed = seed
        self.model: Optional[torch.nn.Module] = None
        self.opt: Optional[torch.optim.Optimizer] = None
        self.engine: Optional[rc.CheckpointEngine] = None
        self.handles: List[rc.SaveHandle] = []
        self.metrics = {}

    def address(self) -> tuple:
        """(this node's IP, a free port): rank 0's, where the group rendezvous (any node of a cluster)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def join(self, ip: str, port: int) -> None:
        """Join the gloo group and build the FSDP2 policy (every rank from the same initial weights)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://{ip}:{port}", rank=self.rank, world_size=self.world)
        mesh = init_device_mesh("cpu", (self.world,))
        self.model = make_policy(self.seed)
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    # -- one PPO update on this rank's slice of the step's samples; FSDP2 averages the gradients
    def update(self, n: int, *parts) -> None:
        batches, ref_logps = parts[:n], parts[n:]
        batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        ref_logp = np.concatenate(ref_logps)
        mine = np.array_split(np.arange(len(ref_logp)), self.world)[self.rank]
        obs, act = batch["obs"][mine], batch["act"][mine]
        old_logp, adv = torch.as_tensor(batch["old_logp"][mine]), torch.as_tensor(batch["adv"][mine])
        for _ in range(PPO_EPOCHS):
            logp = logprobs(self.model, obs, act)
            ratio = torch.exp(logp - old_logp)
            pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
            kl = (logp - torch.as_tensor(ref_logp[mine])).mean()
            (pg + KL_COEF * kl).backward()  # reduce-scatter of the gradients
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.metrics = {"reward": float(batch["reward"].mean()), "kl": float(kl)}

    def weights(self) -> np.ndarray:
        """The full flat weights for the rollout engines (a collective: every rank calls it)."""
        full = [p.full_tensor().reshape(-1) for p in self.model.parameters()]
        return torch.cat(full).detach().numpy().copy()

    def get_metrics(self) -> dict:
        return self.metrics

    # -- checkpointing: the rank pushes its own shards (verl's / DeepSpeed's save_checkpoint's place)
    def state_dicts(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        # DTensors as they are; the optimizer's state keyed by parameter name, not position
        return {"policy": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.opt)}

    def save_checkpoint(self, step: int) -> List[float]:
        """Push this rank's shards for ``step``; returns at once (ms spent in each submit call)."""
        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        ms = []
        for name, state in self.state_dicts().items():
            t0 = time.perf_counter()
            self.handles.append(self.engine.submit(step, name, state, rank=self.rank))
            ms.append((time.perf_counter() - t0) * 1e3)
        self.handles = [h for h in self.handles if not h.done()]
        return ms

    def load_checkpoint(self, step: int) -> dict:
        """Fill this rank's FSDP2 model and AdamW from version ``step``, whatever world size saved it.

        ``get_optimizer_state_dict`` creates AdamW's state (moments, step) if it has none yet; its
        tensors are then filled in place by ``load_into`` (this rank's shards only) and loaded."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if self.engine is None:
            self.engine = rc.CheckpointEngine.connect(self.run)
        sds = self.state_dicts()
        reports = {name: self.engine.load_into(name, sd, step=step, rank=self.rank) for name, sd in sds.items()}
        set_model_state_dict(self.model, sds["policy"])
        set_optimizer_state_dict(self.model, self.opt, sds["optim"])
        return {n: (r.status, r.tier, r.bytes) for n, r in reports.items()}

    def full_state(self) -> dict:
        """Every parameter's and both AdamW moments' full tensor, the step counters and the param
        groups (a collective: every rank calls it; rank 0 returns it)."""
        out = {f"policy/{n}": p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{names[id(p)]}/{k}"] = st[k].full_tensor().clone()
            out[f"optim/{names[id(p)]}/step"] = st["step"].clone()
        out["optim/param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return out if self.rank == 0 else {}

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- the run
def start_group(run: str, world: int, seed: int) -> list:
    """``world`` learner ranks joined in a new gloo group, rendezvous at rank 0's node."""
    return join_group([LearnerRank.remote(run, r, world, seed) for r in range(world)])


def join_group(ranks: list) -> list:
    """Join started learner ranks in a new gloo group, rendezvous at rank 0's node."""
    ip, port = ray.get(ranks[0].address.remote(), timeout=120)
    ray.get([r.join.remote(ip, port) for r in ranks], timeout=120)
    return ranks


def train(run: str, local_dir: str, remote_uri: Optional[str], steps: int, save_every: int,
          kill_at: Optional[int] = None, seed: int = 0, world: int = 2, resume_world: int = 3,
          n_rollout: int = N_ROLLOUT):
    # every actor first: their processes start while the engine's do (none needs the engine to start)
    ranks = [LearnerRank.remote(run, r, world, seed) for r in range(world)]
    rollouts = [RolloutWorker.remote(seed, i) for i in range(n_rollout)]
    reference = ReferenceModel.remote(seed)
    engine = rc.CheckpointEngine.create(run, local_dir=local_dir, remote_uri=remote_uri, keep_last=3,
                                        critical_writers=1, best_effort_writers=0,  # tiny states
                                        max_in_flight=1)  # a save waits for the previous commit (rarely)
    ranks = join_group(ranks)
    loader = PromptLoader(task(seed)[0], PROMPTS_PER_STEP, shuffle_seed=seed)

    # driver-side states: saved by engine.save(step)
    engine.register("reference", reference, strategy=rc.Strategy.RELOADABLE)
    engine.register("dataloader", loader.state_dict, loader=loader.load_state_dict)
    # rank-pushed states: each rank calls engine.submit(step, name, state, rank=r) itself
    for name in ("policy", "optim"):
        engine.register(name, world_size=world)

    st = {"save_ms": [], "submit_ms": [], "versions": {}, "restore_s": None, "restored": None,
          "regroup_s": None,
          "worlds": [world], "restored_identical": None, "mismatched": []}
    saved_full: Dict[int, object] = {}     # step -> the group's full state when it saved (a ref until resolved)
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
                                           "reference_bytes": ref_file.size,
                                           "policy_ranks": len(m.states["policy"].files)}
            handles.remove(h)
            not_uploaded.append(h)
        if wait:
            for h in not_uploaded:
                h.wait(timeout=120, durability="remote")
            not_uploaded.clear()

    step = 0
    while step < steps:
        step += 1
        prompts = np.array_split(loader.next_batch(), n_rollout)
        weights = [r.weights.remote() for r in ranks][0]      # all-gather; broadcast to the rollout engines
        batches = [w.generate.remote(weights, p, step) for w, p in zip(rollouts, prompts)]
        ref_logp = [reference.logprobs.remote(b) for b in batches]
        for r in ranks:
            r.update.remote(len(batches), *batches, *ref_logp)
        if step % save_every == 0:
            t0 = time.perf_counter()
            h = engine.save(step)  # reference + dataloader; opens version `step` (or joins it: no wait)
            st["save_ms"].append((time.perf_counter() - t0) * 1e3)
            handles.append(h)
            saved_full[step] = [r.full_state.remote() for r in ranks][0]  # what this version must hold
            submit_refs += [r.save_checkpoint.remote(step) for r in ranks]  # ranks push their shards
        metrics = ray.get(ranks[0].get_metrics.remote())  # the step's end (also paces the driver)
        collect(wait=False)
        if step % 5 == 0:
            print(f"  step {step:3d}  mean reward {metrics['reward']:+.3f}  kl {metrics['kl']:.4f}  "
                  f"({len(ranks)} ranks)")
        if kill_at is not None and step == kill_at:
            collect(wait=True)  # the run's latest version is durable before the preemption
            st["submit_ms"] += [ms for pair in ray.get(submit_refs) for ms in pair]
            submit_refs = []
            saved_full = {k: ray.get(v) for k, v in saved_full.items()}  # held here, not by the ranks
            print(f"  step {step:3d}  preemption: killing learner rank 1; the group of {len(ranks)} goes "
                  f"and comes back on {resume_world} ranks")
            ray.kill(ranks[1], no_restart=True)
            for r in ranks:
                ray.kill(r, no_restart=True)
            t0 = time.perf_counter()
            ranks = start_group(run, resume_world, seed + 1)  # fresh weights: all of them come from the checkpoint
            st["regroup_s"] = time.perf_counter() - t0
            print(f"  new group of {resume_world} ranks started (processes, gloo, FSDP2 model) in "
                  f"{st['regroup_s']:.1f} s")
            t0 = time.perf_counter()
            report = engine.restore()  # reference + dataloader; pushed states are the ranks' to load
            per_rank = ray.get([r.load_checkpoint.remote(report.step) for r in ranks], timeout=120)
            st["restore_s"] = time.perf_counter() - t0
            states = {n: f"{s.status}/{s.tier}" for n, s in report.states.items()}
            for name in ("policy", "optim"):
                got = {(status, tier) for status, tier, _ in (p[name] for p in per_rank)}
                states[name] = "/".join(next(iter(got))) if len(got) == 1 else str(sorted(got))
            st["restored"] = report
            # right after the restore: the new group holds bit for bit what the old one saved
            now = ray.get([r.full_state.remote() for r in ranks])[0]
            then = saved_full[report.step]
            st["mismatched"] = sorted(k for k in then.keys() | now.keys()
                                      if k not in now or k not in then or not identical(now[k], then[k]))
            st["restored_identical"] = not st["mismatched"]
            for name in ("policy", "optim"):
                engine.register(name, world_size=resume_world, replace=True)  # later versions: the new group
            st["worlds"].append(resume_world)
            step = report.step
            kill_at = None
            print(f"  restored version {report.version} (step {report.step}) onto {resume_world} ranks in "
                  f"{st['restore_s']:.3f}s: " + ", ".join(f"{n}={s}" for n, s in sorted(states.items()))
                  + f"; dataloader at epoch {loader.epoch}, {loader.total_consumed} prompts consumed")
            print(f"  full parameters and AdamW moments after the restore = saved at step {report.step}, bit for "
                  f"bit: {'yes' if st['restored_identical'] else 'NO: ' + ', '.join(st['mismatched'][:5])}")
    st["submit_ms"] += [ms for pair in ray.get(submit_refs) for ms in pair]
    collect(wait=True)
    st["final_reward"] = ray.get(ranks[0].get_metrics.remote())["reward"]
    st["steps_done"] = step
    engine.shutdown()
    ray.get([r.leave.remote() for r in ranks])
    for a in ranks + rollouts + [reference]:
        ray.kill(a)
    return st


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
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, type(a)) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=10, help="kill learner rank 1 after this step (0: never)")
    ap.add_argument("--ranks", type=int, default=2, help="learner ranks (FSDP2 world size) before the preemption")
    ap.add_argument("--resume-ranks", type=int, default=3, help="learner ranks the run resumes on")
    ap.add_argument("--rollout-workers", type=int, default=N_ROLLOUT, help="rollout actors (sampling)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory); the local "
                    "tier is <dir>/local and the remote tier file://<dir>/remote unless given below")
    ap.add_argument("--local-dir", default=None, help="node-local tier; '{node_id}' is replaced per process "
                    "by the node's id (e.g. /ckpt/{node_id})")
    ap.add_argument("--remote-uri", default=None, help="remote tier, any pyarrow.fs URI (e.g. "
                    "s3://ray-ckpt/runs; S3 endpoint and keys from AWS_ENDPOINT_URL_S3 / AWS_ACCESS_KEY_ID / "
                    "AWS_SECRET_ACCESS_KEY)")
    ap.add_argument("--run-prefix", default="openrlhf", help="the run's name is <prefix>-<random>")
    ap.add_argument("--backend", choices=("fsdp2", "deepspeed"), default="fsdp2",
                    help="fsdp2: the toy policy above; deepspeed: OpenRLHF's DeepspeedStrategy on a tiny Qwen2 "
                    "(deepspeed_backend.py; needs OpenRLHF and DeepSpeed, see docs/openrlhf.md)")
    ap.add_argument("--zero-stage", type=int, default=2, help="--backend deepspeed: the ZeRO stage (1, 2 or 3)")
    return ap


def deepspeed_backend():
    """deepspeed_backend.py next to this file, imported by path (this folder is not a package)."""
    import importlib.util
    import sys

    name = "openrlhf_style_deepspeed_backend"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_backend.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.kill_at and not args.save_every <= args.kill_at < args.steps:
        ap.error("--kill-at must be at least --save-every (a version must exist) and below --steps")
    if args.ranks < 2 and args.kill_at or args.ranks < 1 or args.resume_ranks < 1:
        ap.error("--ranks must be at least 2 (rank 1 is killed) and --resume-ranks at least 1")
    if not 1 <= args.rollout_workers <= PROMPTS_PER_STEP:
        ap.error(f"--rollout-workers must be between 1 and {PROMPTS_PER_STEP} (the prompts of a step)")
    if args.backend == "deepspeed":
        deepspeed_backend().check(args, ap.error)
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_openrlhf_")
    started = not ray.is_initialized()
    if started:
        if os.environ.get("RAY_ADDRESS", "local") != "local":  # a cluster (docker/docker-compose.yml)
            ray.init()
        else:  # a private local instance (never another process's cluster)
            ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    local = args.local_dir or os.path.join(root, "local")
    remote = args.remote_uri or "file://" + os.path.join(root, "remote")
    try:
        if args.backend == "deepspeed":
            return deepspeed_backend().main(args, root, local, remote, RESULTS, PromptLoader)
        t0 = time.perf_counter()
        print(f"{args.steps} steps on {args.ranks} FSDP2 ranks, save every {args.save_every}"
              + (f", learner rank 1 killed at step {args.kill_at}, resumed on {args.resume_ranks} ranks"
                 if args.kill_at else ""))
        st = train(f"{args.run_prefix}-{uuid.uuid4().hex[:6]}", local, remote, args.steps, args.save_every,
                   args.kill_at or None, args.seed, args.ranks, args.resume_ranks, args.rollout_workers)
        print(f"done in {time.perf_counter() - t0:.1f} s")
    finally:
        if started:
            ray.shutdown()

    versions = st["versions"]
    first = min(versions)
    ref_home = versions[first]["reference_path"]
    ref_once = all(v["reference_path"] == ref_home for v in versions.values())
    rows = [("steps", str(st["steps_done"])), ("learner ranks", " -> ".join(map(str, st["worlds"]))),
            ("saves", str(len(st["save_ms"]))),
            ("median save() call (driver)", f"{statistics.median(st['save_ms']):.2f} ms"),
            ("median submit() call (rank)", f"{statistics.median(st['submit_ms']):.2f} ms")]
    for v, info in sorted(versions.items()):
        where = "reference written" if info["reference_path"].startswith(f"v{v:012d}/") else \
            f"reference -> v{int(info['reference_path'][1:13])}"
        rows.append((f"bytes written v{v}", f"{info['bytes']:,} ({info['policy_ranks']} ranks, {where})"))
    rep = st["restored"]
    same = st["restored_identical"]
    rows += [("new group started", f"{st['regroup_s']:.1f} s" if rep else "-"),
             ("restore (restore() + load_into)", f"v{rep.version} in {st['restore_s']:.3f} s" if rep else "-"),
             ("restored = saved, bit for bit", "-" if same is None else "yes" if same else "no")]
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
    RESULTS.update(restored_identical=same, mismatched=st["mismatched"], versions=versions,
                   reference_once=ref_once, worlds=st["worlds"], steps_done=st["steps_done"],
                   restored_version=rep.version if rep else None, save_ms=st["save_ms"],
                   submit_ms=st["submit_ms"], restore_s=st["restore_s"])
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same is not False and st["steps_done"] == args.steps else 1


if __name__ == "__main__":
    raise SystemExit(main())
