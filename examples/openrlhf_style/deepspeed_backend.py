"""The example's ``--backend deepspeed`` path: OpenRLHF's own DeepSpeed strategy saving through ray_ckpt,
killed and resumed on another number of ranks.

What OpenRLHF's PPO actor group does with its policy, at toy size on CPU (gloo):

* ``--ranks`` Ray actors, one per rank, each build OpenRLHF's real ``DeepspeedStrategy`` -- here
  ``ray_ckpt.integrations.openrlhf.RayCkptDeepspeedStrategy``, its subclass whose ``save_ckpt`` /
  ``load_ckpt`` go through ray_ckpt -- and a tiny Qwen2 (``from_config``: nothing downloaded)
  prepared by OpenRLHF's ``strategy.prepare`` at ZeRO stage ``--zero-stage``; they train on the
  driver's token batches (the global batch is split over the ranks, whatever their number);
* every ``--save-every`` steps each rank calls ``strategy.save_ckpt(model, <ckpt>/_actor,
  "global_stepN", max_num=3, client_state=...)`` exactly as OpenRLHF's ``PolicyModelActor
  .save_checkpoint`` does; the client_state carries the driver's dataloader position under
  OpenRLHF's keys (``data_loader_state_dict``, ``total_consumed_prompts``);
* at ``--kill-at`` rank 1 is killed; a gloo group cannot lose a member, so the whole group goes
  (a preempted job) and comes back on ``--resume-ranks`` ranks in new processes, which call
  ``strategy.load_ckpt(model, <ckpt>/_actor)`` (the tag in DeepSpeed's ``latest``): each reads only
  the byte ranges of its new ZeRO partition. The driver puts its dataloader back from the
  returned client_state. Right after the load, the full fp32 weights, both Adam moments and the
  16-bit weights (gathered with DeepSpeed's own ``safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state`` / ``GatheredParameters``) and the scheduler and engine counters
  are compared bit for bit with what the old group held when it saved; the run then finishes.

The rank actors run in Ray worker processes, which cannot import this folder: the module ships
itself by value (``register_pickle_by_value``). OpenRLHF and DeepSpeed are imported in the ranks
only, after ``cpu.prepare()`` (see ``ray_ckpt/integrations/openrlhf/cpu.py``).

    python examples/openrlhf_style/train.py --backend deepspeed [--zero-stage 2 --ranks 2 --resume-ranks 3]
"""
from __future__ import annotations

import os
import shutil
import socket
import statistics
import sys
import time
import uuid
from types import SimpleNamespace as NS
from typing import Any, Callable, Dict, List

import numpy as np
import ray
import torch

import ray_ckpt as rc

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

GLOBAL_BATCH, SEQ_LEN, VOCAB, N_SEQS = 12, 16, 256, 96  # 12 sequences a step: 1, 2, 3, 4, 6 or 12 ranks
MAX_NUM = 3  # OpenRLHF's --ckpt.max_num default: the run's retention
OPTIM = {"optim": "adam", "adam": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01},
         "lr_scheduler": "cosine_with_min_lr", "lr_warmup_ratio": 0.1, "scheduler_steps": 100, "max_norm": 1.0}


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


@ray.remote(num_cpus=0.1)
class DeepSpeedRank:
    """One rank of the policy actor group (OpenRLHF's ``PolicyModelActor``), on CPU."""

    def __init__(self, rank: int, world: int, stage: int, settings: Dict[str, Any], seed: int):
        from ray_ckpt.integrations.openrlhf import cpu

        cpu.prepare()  # before OpenRLHF / DeepSpeed are imported: DS_ACCELERATOR=cpu, no flash_attn
        torch.set_num_threads(1)
        self.rank, self.world, self.stage, self.settings, self.seed = rank, world, stage, settings, seed
        self.model = self.opt = self.sched = self.strategy = None

    def address(self) -> tuple:
        """(this node's IP, a free port): rank 0's, where the group rendezvous."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def join(self, ip: str, port: int) -> str:
        """Join the gloo group; build OpenRLHF's strategy and the Qwen2 it prepares (the same
        initial weights on every rank: seeded)."""
        from transformers import AutoModelForCausalLM

        from ray_ckpt.integrations.openrlhf import RayCkptDeepspeedStrategy, cpu

        args = NS(local_rank=-1, ds=NS(param_dtype="bf16"), train=NS(dynamic_batch_enable=False),
                  ray_ckpt=NS(**self.settings))  # what hierarchize makes of --ray_ckpt.* flags
        cls = cpu.torch_adam(RayCkptDeepspeedStrategy)  # torch's AdamW: DeepSpeed compiles nothing
        self.strategy = cls(seed=self.seed, micro_train_batch_size=GLOBAL_BATCH // self.world,
                            train_batch_size=GLOBAL_BATCH, zero_stage=self.stage, args=args)
        cpu.setup_distributed(self.strategy, self.rank, self.world, port, host=ip)
        torch.manual_seed(self.seed)
        model = AutoModelForCausalLM.from_config(qwen2_config())
        self.model, self.opt, self.sched = self.strategy.prepare((model, dict(OPTIM)))
        return type(self.strategy).__name__

    def train_step(self, tokens: np.ndarray) -> float:
        """One optimizer step on this rank's rows of the global batch; this rank's loss."""
        n = len(tokens) // self.world
        mine = torch.as_tensor(tokens[self.rank * n:(self.rank + 1) * n])
        loss = self.model(input_ids=mine, labels=mine).loss
        self.strategy.backward(loss, self.model, self.opt)
        self.strategy.optimizer_step(self.opt, self.model, self.sched)
        return float(loss)

    def save(self, save_dir: str, tag: str, client_state: dict) -> float:
        """OpenRLHF's save call, as ``PolicyModelActor.save_checkpoint`` makes it; ms it blocked."""
        t0 = time.perf_counter()
        self.strategy.save_ckpt(self.model, save_dir, tag, MAX_NUM, 1000, client_state)
        return (time.perf_counter() - t0) * 1e3

    def wait(self, timeout: float) -> None:
        """Every save of this rank committed (rank 0: ``latest`` written), or raise."""
        self.strategy.wait_until_finished(timeout=timeout)

    def load(self, load_dir: str) -> tuple:
        """OpenRLHF's resume: the tag in ``<load_dir>/latest``; (path, client_state, seconds)."""
        t0 = time.perf_counter()
        path, states = self.strategy.load_ckpt(self.model, load_dir)
        return path, states, time.perf_counter() - t0

    def full(self) -> Dict[str, Any]:
        """Full fp32 weights, Adam moments and 16-bit weights, gathered with DeepSpeed's own calls,
        and the scheduler and engine counters (a collective: every rank calls it; rank 0 returns)."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        opt = self.model.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked"):
            # ZeRO-1/2 link the moments of their fragments after the first group's first step
            # only; link every group so that safe_get_full_optimizer_state finds them all
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        out: Dict[str, Any] = {}
        for name, p in self.model.module.named_parameters():
            out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
            with GatheredParameters([p]):
                out[f"lp/{name}"] = p.data.detach().clone()
        sched = self.sched.state_dict()
        out["scalars"] = {"sched": {k: sched[k] for k in ("last_epoch", "_step_count", "_last_lr")},
                          "lr": [g["lr"] for g in self.opt.param_groups],
                          "global_steps": int(self.model.global_steps),
                          "global_samples": int(self.model.global_samples)}
        return out if self.rank == 0 else {}


def start_group(world: int, stage: int, settings: Dict[str, Any], seed: int) -> list:
    """``world`` new rank processes joined in a gloo group (rendezvous at rank 0's node)."""
    ranks = [DeepSpeedRank.remote(r, world, stage, settings, seed) for r in range(world)]
    ip, port = ray.get(ranks[0].address.remote(), timeout=240)  # the first call waits for the process
    ray.get([r.join.remote(ip, port) for r in ranks], timeout=240)
    return ranks


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            a.reshape(-1).view(torch.uint8).numpy().tobytes() == b.reshape(-1).view(torch.uint8).numpy().tobytes()
    return a == b


def mismatched(then: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    return sorted(k for k in then.keys() | now.keys() if k not in now or k not in then or not same_bits(now[k], then[k]))


def check(args: Any, error: Callable[[str], None]) -> None:
    """The deepspeed path's own checks, before Ray starts (``error`` exits, as argparse's does)."""
    import importlib.util

    missing = [m for m in ("openrlhf", "deepspeed") if importlib.util.find_spec(m) is None]
    if missing:
        error(f"--backend deepspeed needs {' and '.join(missing)}: see docs/openrlhf.md (install)")
    if args.zero_stage not in (1, 2, 3):
        error("--zero-stage must be 1, 2 or 3 (ray_ckpt refuses ZeRO-0)")
    for flag, n in (("--ranks", args.ranks), ("--resume-ranks", args.resume_ranks)):
        if GLOBAL_BATCH % n:
            error(f"{flag} must divide the global batch of {GLOBAL_BATCH} sequences (1, 2, 3, 4, 6 or 12)")


class _Run:
    """The driver's side of one run: the rank group, the dataloader, what each save held."""

    def __init__(self, args: Any, local: str, remote: str, save_dir: str, loader: Any):
        self.args, self.save_dir, self.loader = args, save_dir, loader
        prefix = f"{args.run_prefix}-{uuid.uuid4().hex[:6]}"
        # rank 0 creates the run "<prefix>-actor" (get-or-create) on its first save_ckpt
        self.settings = {"run": prefix, "local_dir": local, "remote_uri": remote}
        self.run = f"{prefix}-actor"
        self.ranks: list = []
        self.st: Dict[str, Any] = {"save_ms": [], "first_save_ms": [], "worlds": [], "restored": None, "load_s": None,
                                   "regroup_s": None, "restored_identical": None, "mismatched": [], "losses": []}
        self.saved_full: Dict[int, Any] = {}
        self.restore_ahead = bool(args.kill_at)
        self.group_saved = False  # a group's first save_ckpt creates / connects to the run (a collective)

    def start(self, world: int, seed: int) -> float:
        """A new group of ``world`` ranks; the seconds it took to start."""
        t0 = time.perf_counter()
        self.ranks = start_group(world, self.args.zero_stage, self.settings, seed)
        self.group_saved = False
        self.st["worlds"].append(world)
        return time.perf_counter() - t0

    def step(self, step: int) -> None:
        tokens = self.loader.next_batch()
        losses = ray.get([r.train_step.remote(tokens) for r in self.ranks], timeout=240)
        self.st["losses"].append(float(np.mean(losses)))
        if step % self.args.save_every == 0:
            client_state = {"global_step": step, "total_consumed_prompts": self.loader.total_consumed,
                            "data_loader_state_dict": self.loader.state_dict()}
            ms = ray.get([r.save.remote(self.save_dir, f"global_step{step}", client_state) for r in self.ranks],
                         timeout=240)
            self.st["save_ms" if self.group_saved else "first_save_ms"].append(max(ms))  # the slowest rank's
            self.group_saved = True
            if self.restore_ahead:  # what this version must hold if the group resumes from it
                self.saved_full[step] = [r.full.remote() for r in self.ranks][0]

    def wait_saves(self) -> None:
        ray.get([r.wait.remote(240) for r in self.ranks], timeout=300)

    def preempt_and_resume(self, seed: int) -> int:
        """Kill rank 1 (the whole group goes), start ``--resume-ranks`` new ones, load_ckpt; the step resumed."""
        a = self.args
        self.wait_saves()  # the run's latest save committed before the preemption, as in the FSDP2 path
        saved = {k: ray.get(v, timeout=240) for k, v in self.saved_full.items()}
        self.restore_ahead, self.saved_full = False, {}
        print(f"  preemption: killing rank 1; the group of {len(self.ranks)} goes and comes back on "
              f"{a.resume_ranks} ranks")
        ray.kill(self.ranks[1], no_restart=True)
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.st["regroup_s"] = self.start(a.resume_ranks, seed)  # other initial weights: all must come back
        print(f"  new group of {a.resume_ranks} ranks started (processes, gloo, OpenRLHF's prepare) in "
              f"{self.st['regroup_s']:.1f} s")
        loaded = ray.get([r.load.remote(self.save_dir) for r in self.ranks], timeout=300)
        path, client_state, _ = loaded[0]
        self.st["load_s"] = max(s for _, _, s in loaded)
        self.loader.load_state_dict(client_state["data_loader_state_dict"])
        step = int(client_state["global_step"])
        now = ray.get([r.full.remote() for r in self.ranks], timeout=240)[0]
        self.st["mismatched"] = mismatched(saved[step], now)
        self.st["restored_identical"] = not self.st["mismatched"]
        self.st["restored"] = {"path": path, "step": step, "client_state": client_state}
        print(f"  restored {os.path.basename(path)} onto {a.resume_ranks} ranks with load_ckpt in "
              f"{self.st['load_s']:.2f} s; dataloader at epoch {self.loader.epoch}, "
              f"{client_state['total_consumed_prompts']} sequences consumed")
        same = self.st["restored_identical"]
        print(f"  full fp32 weights, Adam moments and 16-bit weights after load_ckpt = saved at step {step}, "
              f"bit for bit: {'yes' if same else 'NO: ' + ', '.join(self.st['mismatched'][:5])}")
        return step

    def close(self) -> List[rc.CheckpointMeta]:
        """Wait for the last saves, list the committed versions, stop the run's coordinator."""
        self.wait_saves()
        engine = rc.CheckpointEngine.connect(self.run)
        kept = engine.list_checkpoints()
        engine.shutdown(timeout=120, stop_coordinator=True)  # waits for the uploads in progress
        for r in self.ranks:
            ray.kill(r)
        return kept


def train(args: Any, local: str, remote: str, save_dir: str, loader: Any) -> Dict[str, Any]:
    run = _Run(args, local, remote, save_dir, loader)
    run.start(args.ranks, args.seed)
    step, kill_at = 0, args.kill_at or None
    while step < args.steps:
        step += 1
        run.step(step)
        if step % 5 == 0:
            print(f"  step {step:3d}  mean loss {run.st['losses'][-1]:.4f}  ({len(run.ranks)} ranks)")
        if kill_at is not None and step == kill_at:
            step, kill_at = run.preempt_and_resume(args.seed + 1), None
    run.st["versions"] = run.close()
    run.st["steps_done"] = step
    run.st["run"] = run.run
    return run.st


def print_table(rows: List[tuple]) -> None:
    kw = max(len(k) for k, _ in rows)
    vw = max(16, max(len(v) for _, v in rows))
    print("+-" + "-" * kw + "-+-" + "-" * vw + "-+")
    for k, v in rows:
        print(f"| {k:<{kw}} | {v:>{vw}} |")
    print("+-" + "-" * kw + "-+-" + "-" * vw + "-+")


def main(args: Any, root: str, local: str, remote: str, results: Dict[str, Any], loader_cls: type) -> int:
    """Run the deepspeed path in a started Ray; fill ``results``; 0 when it finished bit-exact."""
    rng = np.random.default_rng(args.seed + 12345)
    loader = loader_cls(rng.integers(0, VOCAB, (N_SEQS, SEQ_LEN)), GLOBAL_BATCH, shuffle_seed=args.seed)
    save_dir = os.path.join(root, "ckpt_path", "_actor")  # OpenRLHF's <ckpt.path>/_actor
    t0 = time.perf_counter()
    print(f"{args.steps} steps on {args.ranks} DeepSpeed ZeRO-{args.zero_stage} ranks (OpenRLHF's strategy), "
          f"save_ckpt every {args.save_every}"
          + (f", rank 1 killed at step {args.kill_at}, resumed on {args.resume_ranks} ranks" if args.kill_at else ""))
    st = train(args, local, remote, save_dir, loader)
    print(f"done in {time.perf_counter() - t0:.1f} s")

    rep, same, versions = st["restored"], st["restored_identical"], st["versions"]
    rows = [("steps", str(st["steps_done"])), ("ZeRO stage", str(args.zero_stage)),
            ("ranks", " -> ".join(map(str, st["worlds"]))),
            ("saves (save_ckpt on every rank)", str(len(st["save_ms"]) + len(st["first_save_ms"]))),
            ("a group's first save_ckpt (run set-up)", " / ".join(f"{ms:.0f} ms" for ms in st["first_save_ms"])),
            ("median later save_ckpt block", f"{statistics.median(st['save_ms']):.1f} ms" if st["save_ms"] else "-")]
    rows += [(f"global_step{m.step} kept", f"{m.bytes:,} B on {'+'.join(m.tiers)}") for m in versions]
    rows += [("new group started", f"{st['regroup_s']:.1f} s" if rep else "-"),
             ("load_ckpt (slowest rank)", f"global_step{rep['step']} in {st['load_s']:.2f} s" if rep else "-"),
             ("restored = saved, bit for bit", "-" if same is None else "yes" if same else "no")]
    print()
    print_table(rows)
    print(f"committed versions kept (max_num={MAX_NUM}): " + ", ".join(f"global_step{m.step}" for m in versions))
    results.clear()
    results.update(backend="deepspeed", zero_stage=args.zero_stage, run=st["run"], restored_identical=same,
                   mismatched=st["mismatched"], worlds=st["worlds"], steps_done=st["steps_done"],
                   restored_step=rep["step"] if rep else None, restored_path=rep["path"] if rep else None,
                   client_state=rep["client_state"] if rep else None, versions=[m.step for m in versions],
                   version_bytes={m.step: m.bytes for m in versions}, save_ms=st["save_ms"],
                   first_save_ms=st["first_save_ms"], load_s=st["load_s"],
                   losses=st["losses"], save_dir=save_dir)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if same is not False and st["steps_done"] == args.steps else 1
