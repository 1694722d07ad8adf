"""A rank of SkyRL's FSDP2 training on CPU, as a Ray actor: what tests/test_skyrl.py, docs/skyrl.md's
test and benchmarks/skyrl_save.py share.

Each actor imports SkyRL once (the expensive part; its CUDA calls stood in for by
``ray_ckpt.integrations.skyrl.cpu``) and can then join gloo groups of different sizes, build a tiny
Qwen2 (``transformers.Qwen2Config``, ``from_config``, no download) with SkyRL's real
``FSDPStrategy.setup_distributed`` / ``prepare`` (its ``fully_shard``, AdamW and LR scheduler),
train with the strategy's ``backward`` / ``optimizer_step``, and save and load with
``RayCkptFSDPStrategy`` or with SkyRL's own ``FSDPStrategy.save_checkpoint`` on the same state.

tests/ is not importable in Ray workers: a module that ships this into actors registers it by
value (``ray.cloudpickle.register_pickle_by_value``)."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional

import ray
import torch


def qwen2_config(hidden: int = 64, layers: int = 2, vocab: int = 256):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attn_implementation="eager")


def skyrl_configs() -> Dict[str, Any]:
    """SkyRL's own config dataclasses, as a small run would set them (fp32 parameters on CPU)."""
    from skyrl.train.config import FSDPConfig, MixedPrecisionConfig, ModelConfig, OptimizerConfig

    return {"fsdp_config": FSDPConfig(mixed_precision=MixedPrecisionConfig(param_dtype="fp32")),
            "optimizer_config": OptimizerConfig(lr=1e-2, weight_decay=0.01, num_warmup_steps=2,
                                                scheduler="cosine"),
            "model_config": ModelConfig(), "num_training_steps": 20}


@ray.remote(num_cpus=0.1)
class SkyRLRank:
    def __init__(self):
        from ray_ckpt.integrations.skyrl import cpu

        cpu.prepare()
        torch.set_num_threads(1)
        from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy  # noqa: F401

        import ray_ckpt.integrations.skyrl.strategy  # noqa: F401

        self.model = self.strategy = None

    def pid(self) -> int:
        return os.getpid()

    def join(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        self.leave()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ.pop("LOCAL_RANK", None)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def leave(self) -> None:
        import torch.distributed as dist

        self.model = self.strategy = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def build(self, ray_ckpt: Optional[dict] = None, seed: int = 0, size: tuple = (64, 2, 256)) -> str:
        """SkyRL's strategy (ours with ``ray_ckpt`` settings, else the stock one) and a Qwen2 prepared
        by it (``size``: hidden, layers, vocabulary): the same initial weights on every rank (seeded)."""
        from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
        from transformers import AutoModelForCausalLM

        from ray_ckpt.integrations.skyrl import RayCkptFSDPStrategy

        kw = skyrl_configs()
        self.strategy = RayCkptFSDPStrategy(ray_ckpt=ray_ckpt, seed=seed, **kw) if ray_ckpt is not None else \
            FSDPStrategy(seed=seed, **kw)
        self.strategy.setup_distributed()
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(qwen2_config(*size))
        self.model, self.opt, self.sched = self.strategy.prepare((model, None, None))
        return type(self.strategy).__name__

    def train(self, first: int, steps: int, seed: int = 0) -> torch.Tensor:
        """Steps ``first .. first+steps-1`` through the strategy's ``backward`` / ``optimizer_step``,
        each rank's tokens a function of (seed, step, rank); the last step's logits."""
        for step in range(first, first + steps):
            g = torch.Generator().manual_seed(1000 * seed + step)
            batch = torch.randint(0, 256, (6, 12), generator=g)
            mine = batch[self.rank::self.world][:1]
            out = self.model(input_ids=mine, labels=mine)
            self.strategy.backward(out.loss, self.model, self.opt)
            self.strategy.optimizer_step(self.opt, self.model, self.sched)
        return out.logits.detach().float().clone()

    def save(self, ckpt_dir: str, client_state: Optional[dict] = None) -> float:
        t0 = time.perf_counter()
        self.strategy.save_checkpoint(self.model, ckpt_dir, node_local_rank=self.rank, optimizer=self.opt,
                                      scheduler=self.sched, client_state=client_state or {}, tag=None)
        return time.perf_counter() - t0

    def stock_save(self, ckpt_dir: str) -> float:
        """SkyRL's own ``FSDPStrategy.save_checkpoint`` of the same state (the benchmark's baseline)."""
        from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy

        t0 = time.perf_counter()
        FSDPStrategy.save_checkpoint(self.strategy, self.model, ckpt_dir, node_local_rank=self.rank,
                                     optimizer=self.opt, scheduler=self.sched, client_state={}, tag=None)
        return time.perf_counter() - t0

    def wait(self, timeout: float) -> Optional[str]:
        try:
            self.strategy.wait_until_finished(timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def load(self, ckpt_dir: str):
        try:
            return self.strategy.load_checkpoint(self.model, ckpt_dir, optimizer=self.opt, scheduler=self.sched)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def full(self) -> Dict[str, Any]:
        """Full parameters and AdamW moments (collective), the scheduler and learning rates; rank 0
        returns them."""
        out = {f"model/{n}": p.full_tensor() for n, p in self.model.named_parameters()}
        ids = {id(p): i for i, p in enumerate(self.model.parameters())}
        for p, st in self.opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optim/{ids[id(p)]}/{k}"] = st[k].full_tensor()
            out[f"optim/{ids[id(p)]}/step"] = st["step"].clone()
        sched = self.sched.state_dict()
        plain = {"sched": {k: sched[k] for k in ("last_epoch", "_step_count", "base_lrs", "_last_lr")},
                 "lr": [g["lr"] for g in self.opt.param_groups]}
        return {"tensors": out, "plain": plain} if self.rank == 0 else {}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=tokens).logits.float()

    def call(self, fn, *args):
        return fn(self, *args)
