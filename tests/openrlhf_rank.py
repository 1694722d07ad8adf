"""A rank of OpenRLHF's DeepSpeed training on CPU, as a Ray actor: what tests/test_openrlhf.py,
docs/openrlhf.md's test and benchmarks/deepspeed_save.py share.

Each actor imports OpenRLHF and DeepSpeed once (the expensive part) and can then join gloo groups
of different sizes, build a tiny Qwen2 (``transformers.Qwen2Config``, ``from_config``, no
download) under OpenRLHF's real ``DeepspeedStrategy.prepare`` at any ZeRO stage, train, save and
load with ``RayCkptDeepspeedStrategy`` or OpenRLHF's stock strategy.

tests/ is not importable in Ray workers: a module that ships this into actors registers it by
value (``ray.cloudpickle.register_pickle_by_value``)."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace as NS
from typing import Any, Dict, Optional

import ray
import torch


def qwen2_config(hidden: int = 64, layers: int = 2):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def strategy_args(ray_ckpt: Optional[dict] = None) -> NS:
    """The part of OpenRLHF's hierarchized args the strategy reads (``args.ds``, ``args.train``)."""
    args = NS(local_rank=-1, ds=NS(param_dtype="bf16"), train=NS(dynamic_batch_enable=False))
    if ray_ckpt is not None:
        args.ray_ckpt = NS(**ray_ckpt)
    return args


OPTIM = {"optim": "adam", "adam": {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01},
         "lr_scheduler": "cosine_with_min_lr", "lr_warmup_ratio": 0.1, "scheduler_steps": 20, "max_norm": 1.0}


@ray.remote(num_cpus=0.1)
class DSRank:
    def __init__(self):
        from ray_ckpt.integrations.openrlhf import cpu

        cpu.prepare()
        torch.set_num_threads(1)
        from openrlhf.utils.deepspeed import DeepspeedStrategy  # noqa: F401  (the import time is paid here)

        import ray_ckpt.integrations.openrlhf.strategy  # noqa: F401

        self.model = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, rank: int, world: int, port: int) -> None:
        self.leave()
        self.rank, self.world, self.port = rank, world, port

    def leave(self) -> None:
        """Forget the gloo group and what DeepSpeed cached of it (its groups, its comm backend)."""
        import deepspeed.comm.comm as dcomm
        import deepspeed.utils.groups as groups
        import torch.distributed as dist

        self.model = self.strategy = None
        if dist.is_initialized():
            dist.destroy_process_group()
        dcomm.cdb = None
        for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "mpu", "mesh_device",
                     "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            if hasattr(groups, name):
                setattr(groups, name, None)
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP"):
            getattr(groups, name).clear()
        # ZeRO-3 numbers the modules and parameters it partitions with process-wide counters (a
        # mutable default of _register_deepspeed_module, Init.param_id) and checks at each forward
        # that every rank traced the same numbers: ranks whose processes built different numbers of
        # ZeRO-3 models would disagree
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
        from deepspeed.runtime.zero.partition_parameters import Init

        DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
        Init.param_id = 0

    def build(self, stage: int, ray_ckpt: Optional[dict] = None, seed: int = 0, hidden: int = 64,
              layers: int = 2, ds: Optional[dict] = None, freeze: tuple = ()) -> str:
        """OpenRLHF's strategy (ours with ``ray_ckpt`` settings, else the stock one) and a Qwen2
        prepared by it: the same initial weights on every rank (seeded); the parameters named in
        ``freeze`` get ``requires_grad=False`` before ``prepare`` (a frozen embedding). ``ds``
        sets ``args.ds`` entries (the ``--ds.*`` flags: ``grad_accum_dtype``, ``adam_offload``);
        with ``adam_offload`` DeepSpeed picks its own optimizer (DeepSpeedCPUAdam), as on a GPU."""
        from openrlhf.utils.deepspeed import DeepspeedStrategy
        from transformers import AutoModelForCausalLM

        from ray_ckpt.integrations.openrlhf import RayCkptDeepspeedStrategy, cpu

        base = RayCkptDeepspeedStrategy if ray_ckpt is not None else DeepspeedStrategy
        cls = base if (ds or {}).get("adam_offload") else cpu.torch_adam(base)
        args = strategy_args(ray_ckpt)
        vars(args.ds).update(ds or {})  # e.g. use_universal_ckpt (--ds.use_universal_ckpt)
        self.strategy = cls(seed=seed, micro_train_batch_size=1, train_batch_size=self.world, zero_stage=stage,
                            args=args)
        cpu.setup_distributed(self.strategy, self.rank, self.world, self.port)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(qwen2_config(hidden, layers))
        for name, p in model.named_parameters():
            p.requires_grad_(name not in freeze)
        self.model, self.opt, self.sched = self.strategy.prepare((model, dict(OPTIM)))
        return type(self.strategy).__name__

    def optimizers(self) -> tuple:
        """(DeepSpeed's optimizer, the torch optimizer it wraps), by class name."""
        opt = self.model.optimizer
        return type(opt).__name__, type(getattr(opt, "optimizer", None)).__name__

    def train(self, first: int, steps: int, seed: int = 0) -> torch.Tensor:
        """Steps ``first .. first+steps-1``, each rank's tokens a function of (seed, step, rank) and
        the data-parallel size (the global batch is split over the ranks); the last step's logits."""
        for step in range(first, first + steps):
            g = torch.Generator().manual_seed(1000 * seed + step)
            batch = torch.randint(0, 256, (6, 12), generator=g)
            mine = batch[self.rank::self.world][:1]
            out = self.model(input_ids=mine, labels=mine)
            self.strategy.backward(out.loss, self.model, self.opt)
            self.strategy.optimizer_step(self.opt, self.model, self.sched)
        return out.logits.detach().float().clone()

    def save(self, save_dir: str, tag: str, client_state: Optional[dict] = None, max_num: int = 3) -> float:
        t0 = time.perf_counter()
        self.strategy.save_ckpt(self.model, save_dir, tag, max_num=max_num, client_state=client_state)
        return time.perf_counter() - t0

    def save_between_backward_and_step(self, save_dir: str, tag: str, step: int) -> Dict[str, Any]:
        """Training step ``step`` (as :meth:`train`) with ``save_ckpt`` between its backward and its
        optimizer step: the step changes the fp32 masters and moments right after the call
        returns, while an overlapped copy may still read them. Returns how long the call blocked
        and what the step's fence waited (this process's copier)."""
        from ray_ckpt.capture.overlap import process_copier

        g = torch.Generator().manual_seed(step)
        mine = torch.randint(0, 256, (6, 12), generator=g)[self.rank::self.world][:1]
        self.strategy.backward(self.model(input_ids=mine, labels=mine).loss, self.model, self.opt)
        copier = process_copier()
        before = len(copier.fence_waits) if copier is not None else 0
        blocked = self.save(save_dir, tag)
        self.strategy.optimizer_step(self.opt, self.model, self.sched)
        copier = process_copier()
        waits = list(copier.fence_waits[before:]) if copier is not None else []
        return {"blocked_s": blocked, "fence_waits": len(waits), "fence_wait_s": sum(waits)}

    def wait(self, timeout: float) -> Optional[str]:
        try:
            self.strategy.wait_until_finished(timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def load(self, load_dir: str, tag: Optional[str] = None, **kw: Any):
        try:
            path, states = self.strategy.load_ckpt(self.model, load_dir, tag, **kw)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return path, states

    def full(self, moments: bool = True) -> Dict[str, Any]:
        """Full fp32 masters, Adam moments and 16-bit weights, gathered with DeepSpeed's own calls
        (collective), and the scalars; rank 0 returns them."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        opt = self.model.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked"):
            # DeepSpeed links the moments of ZeRO-1/2's fragments after the first group's first
            # step only; link every group so that safe_get_full_optimizer_state finds them
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        out = {}
        for name, p in self.model.module.named_parameters():
            if p.requires_grad:  # a frozen parameter has no fp32 master nor moments: its 16-bit values only
                out[f"fp32/{name}"] = safe_get_full_fp32_param(p).clone()
            for key in ("exp_avg", "exp_avg_sq") if moments and p.requires_grad else ():
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).clone()
            with GatheredParameters([p]):
                out[f"lp/{name}"] = p.data.detach().clone()
        sched = self.sched.state_dict()
        scalars = {"sched": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")},
                   "lr": [g["lr"] for g in self.opt.param_groups], "global_steps": self.model.global_steps,
                   "global_samples": self.model.global_samples}
        return {"tensors": out, "scalars": scalars} if self.rank == 0 else {}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=tokens).logits.float()

    def call(self, fn, *args):
        return fn(self, *args)
