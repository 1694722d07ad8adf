"""Running OpenRLHF's DeepSpeed path on a CPU-only machine (gloo): for tests, the benchmark and
trying the integration out without a GPU. Not needed on GPUs.

Three things of OpenRLHF assume CUDA; :func:`prepare` and :func:`setup_distributed` handle them
the way a CPU test has to:

* ``openrlhf.models.ring_attn_utils`` imports ``flash_attn`` at module level (no CPU build):
  :func:`prepare` registers empty ``flash_attn`` modules when the package is absent (ring
  attention, which would use them, is off at ``ring_attn_size=1``);
* ``torch_dist_barrier_and_cuda_sync`` (stock ``save_ckpt``) calls ``torch.cuda.synchronize()``:
  on a build without CUDA :func:`prepare` makes it a no-op (there is nothing to synchronise);
* ``DeepspeedStrategy.setup_distributed`` calls ``torch.cuda.set_device`` and builds a "cuda"
  device mesh: :func:`setup_distributed` does the same set-up with gloo and a "cpu" mesh;
* DeepSpeed compiles ops on first use unless told otherwise: :func:`torch_adam` asks for torch's
  AdamW (not FusedAdam) and :func:`prepare` turns off the CPU backend's shared-memory all-reduce.

DeepSpeed itself needs ``DS_ACCELERATOR=cpu`` and ``LOCAL_RANK`` in the environment before it is
imported (:func:`prepare` sets both when unset)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any


def prepare() -> None:
    """Call before importing OpenRLHF or DeepSpeed in a CPU process."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "flash_attn" not in sys.modules and importlib.util.find_spec("flash_attn") is None:
        names = {"flash_attn": [], "flash_attn.bert_padding": ["index_first_axis", "pad_input", "rearrange",
                                                                "unpad_input"],
                 "flash_attn.utils": [], "flash_attn.utils.distributed": ["all_gather"]}
        for name, attrs in names.items():
            mod = types.ModuleType(name)
            package = name in ("flash_attn", "flash_attn.utils")
            if package:
                mod.__path__ = []
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
            for attr in attrs:
                setattr(mod, attr, None)
            sys.modules[name] = mod
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
        import deepspeed.ops

        # DeepSpeed's CPU backend compiles a shared-memory all-reduce (a C++ op, for inference) when
        # its communication starts; gloo's own all-reduce serves training, and nothing is compiled
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def setup_distributed(strategy: Any, rank: int, world_size: int, port: int, host: str = "127.0.0.1") -> None:
    """What ``DeepspeedStrategy.setup_distributed`` does, with gloo and a CPU device mesh
    (data parallel only)."""
    import deepspeed
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    transformers.set_seed(strategy.seed)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=str(port),
                      LOCAL_RANK="0")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
    deepspeed.init_distributed(dist_backend="gloo")
    strategy.world_size = world_size
    strategy.ds_device_mesh = init_device_mesh("cpu", (world_size, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
    strategy.ring_attn_rank = 0
    strategy.accumulated_gradient = max(1, strategy.train_batch_size // strategy.micro_train_batch_size // world_size)


def torch_adam(strategy_cls: type) -> type:
    """``strategy_cls`` whose DeepSpeed config asks for torch's AdamW (``torch_adam``) instead of
    FusedAdam, which DeepSpeed would compile on first use on a CPU."""

    class TorchAdam(strategy_cls):
        def get_ds_train_config(self, *args: Any, **kwargs: Any) -> dict:
            config = super().get_ds_train_config(*args, **kwargs)
            if "optimizer" in config:
                config["optimizer"]["params"]["torch_adam"] = True
            return config

    TorchAdam.__name__ = TorchAdam.__qualname__ = f"TorchAdam{strategy_cls.__name__}"
    return TorchAdam
