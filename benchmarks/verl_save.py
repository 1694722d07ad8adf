"""verl's checkpoint save and load: ray_ckpt's RayCkptCheckpointManager vs verl's own
FSDPCheckpointManager, on the same FSDP2 model (issue 28).

Two Ray rank actors (gloo, CPU) build a Qwen2 (``transformers.Qwen2Config``, ``from_config``)
wrapped by verl's ``apply_fsdp2``, AdamW and verl's cosine scheduler, train one step (the optimizer
state exists), then, ``--repeats`` times each:

* ray_ckpt: ``save_checkpoint`` on both ranks; "blocks" is the longest a rank's call took, "to
  commit" the time until ``wait_until_finished`` returned on every rank (the version durable on the
  local tier: written, checksummed, fsync'ed, manifest renamed in, pointer and tracker written);
* verl: ``FSDPCheckpointManager.save_checkpoint`` on both ranks: it blocks until its files are
  written (``torch.save``, no fsync: the page cache may still hold them);
* load on 2 ranks (both managers) and on 1 rank (ray_ckpt only: verl's files are per world size).

Besides the wall times it reports the CPU seconds of the rank's calling thread (``time.thread_time``:
user and system, the reads' ``pread`` included), which other work on a shared machine does not
inflate: the wall-time ratios move with the load average, these do much less.

    python benchmarks/verl_save.py [--hidden 768 --layers 6 --vocab 32000 --repeats 3 --dir /tmp/verl_bench]
                                   [--prefault] [--store-gb 4] [--no-overlap]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import ray
import torch

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(num_cpus=0.5)
class Rank:
    def __init__(self):
        torch.set_num_threads(1)
        os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
        from verl.utils.fsdp_utils import apply_fsdp2  # noqa: F401

    def join(self, rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def build(self, cfg: dict, ckpt: dict) -> int:
        from omegaconf import OmegaConf
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoModelForCausalLM, Qwen2Config
        from verl.trainer.config import CheckpointConfig
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.fsdp_utils import apply_fsdp2
        from verl.utils.torch_functional import get_cosine_schedule_with_warmup

        from ray_ckpt.integrations.verl import RayCkptCheckpointManager

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg, attn_implementation="eager"))
        apply_fsdp2(model, {"mesh": init_device_mesh("cpu", (self.world,)), "reshard_after_forward": True}, {})
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.sched = get_cosine_schedule_with_warmup(self.opt, num_warmup_steps=2, num_training_steps=100)
        self.ours = RayCkptCheckpointManager(model=model, optimizer=self.opt, lr_scheduler=self.sched,
                                             checkpoint_config=omega_conf_to_dataclass(OmegaConf.create(ckpt)))
        self.stock = FSDPCheckpointManager(model=model, optimizer=self.opt, lr_scheduler=self.sched,
                                           checkpoint_config=CheckpointConfig())
        return sum(p.numel() for p in model.parameters())  # global numel (DTensors)

    def train(self) -> None:
        tokens = torch.randint(0, 1000, (1, 32))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def save(self, which: str, path: str, step: int) -> tuple:
        """(seconds the call took, CPU seconds of this thread in it: what a shared machine does not inflate)"""
        import torch.distributed as dist

        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        (self.ours if which == "ray_ckpt" else self.stock).save_checkpoint(path, None, global_step=step)
        return time.perf_counter() - t0, time.thread_time() - c0

    def wait(self) -> float:
        t0 = time.perf_counter()
        self.ours.wait_until_finished(timeout=600)
        return time.perf_counter() - t0

    def load(self, which: str, path: str) -> tuple:
        """(seconds until every rank loaded, CPU seconds of this rank's thread in its call)"""
        import torch.distributed as dist

        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        (self.ours if which == "ray_ckpt" else self.stock).load_checkpoint(path)
        cpu = time.thread_time() - c0
        dist.barrier()
        return time.perf_counter() - t0, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/verl_bench")
    ap.add_argument("--prefault", action="store_true",
                    help="engine option prefault_object_store: each rank maps Ray's object store once, ahead")
    ap.add_argument("--store-gb", type=float, default=4.0, help="Ray's object store size")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the ray_ckpt block's overlap: false (the copy into the object store inside save_checkpoint)")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=int(args.store_gb * (1 << 30)))
    cfg = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
               num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
               num_key_value_heads=max(1, args.hidden // 256), tie_word_embeddings=False)
    run = "verl-bench"
    ckpt = {"_target_": "ray_ckpt.integrations.verl.RayCkptCheckpointConfig",
            "ray_ckpt": {"run": run, "local_dir": f"{args.dir}/ray_ckpt", "critical_writers": 2,
                         "best_effort_writers": 0, "overlap": not args.no_overlap,
                         "engine_options": {"prefault_object_store": args.prefault}}}
    actors = [Rank.remote() for _ in range(3)]

    def group(world: int, first: int = 0) -> list:
        port, rs = free_port(), actors[first:first + world]
        ray.get([a.join.remote(r, world, port) for r, a in enumerate(rs)])
        return rs

    two = group(2)
    numel = ray.get([a.build.remote(cfg, ckpt) for a in two])[0]
    ray.get([a.train.remote() for a in two])
    rows = {"ray_ckpt": {"block": [], "commit": [], "cpu": []}, "verl": {"block": [], "cpu": []}}
    for i in range(args.repeats):
        step = i + 1
        path = f"{args.dir}/trainer/global_step_{step}/actor"
        t0 = time.perf_counter()
        blocks = ray.get([a.save.remote("ray_ckpt", path, step) for a in two])
        ray.get([a.wait.remote() for a in two])
        rows["ray_ckpt"]["commit"].append(time.perf_counter() - t0)
        rows["ray_ckpt"]["block"].append(max(b for b, _ in blocks))
        rows["ray_ckpt"]["cpu"].append(max(c for _, c in blocks))
        blocks = ray.get([a.save.remote("verl", f"{args.dir}/stock/global_step_{step}/actor", step) for a in two])
        rows["verl"]["block"].append(max(b for b, _ in blocks))
        rows["verl"]["cpu"].append(max(c for _, c in blocks))
    last = args.repeats
    ours_path = f"{args.dir}/trainer/global_step_{last}/actor"
    stock_path = f"{args.dir}/stock/global_step_{last}/actor"
    load2 = {w: [] for w in ("ray_ckpt", "verl")}
    cpu2 = {w: [] for w in ("ray_ckpt", "verl")}
    for _ in range(args.repeats):
        for which, path in (("ray_ckpt", ours_path), ("verl", stock_path)):
            got = ray.get([a.load.remote(which, path) for a in two])
            load2[which].append(max(w for w, _ in got))
            cpu2[which].append(max(c for _, c in got))
    one = group(1, first=2)
    ray.get(one[0].build.remote(cfg, ckpt))
    load1 = [ray.get(one[0].load.remote("ray_ckpt", ours_path))[0] for _ in range(args.repeats)]

    med = statistics.median
    mb = numel * 4 / 1e6
    print(f"\nQwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {numel / 1e6:.1f} M parameters, "
          f"{mb:.0f} MB fp32 weights (+ {2 * mb:.0f} MB AdamW moments); 2 FSDP2 ranks (gloo, CPU); "
          f"median of {args.repeats}; overlap={not args.no_overlap}, prefault_object_store={args.prefault}, "
          f"object store {args.store_gb} GB\n")
    print("| | ray_ckpt | verl FSDPCheckpointManager | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| save_checkpoint blocks a rank | {med(rows['ray_ckpt']['block']):.3f} s | "
          f"{med(rows['verl']['block']):.3f} s | {med(rows['ray_ckpt']['block']) / med(rows['verl']['block']):.2f}x |")
    print(f"| save to a committed version | {med(rows['ray_ckpt']['commit']):.3f} s (fsync'ed, checksummed) | "
          f"{med(rows['verl']['block']):.3f} s (torch.save, no fsync) | "
          f"{med(rows['ray_ckpt']['commit']) / med(rows['verl']['block']):.2f}x |")
    print(f"| load, same world size (2) | {med(load2['ray_ckpt']):.3f} s | {med(load2['verl']):.3f} s | "
          f"{med(load2['ray_ckpt']) / med(load2['verl']):.2f}x |")
    print(f"| load, another world size (1) | {med(load1):.3f} s | cannot | |")
    print(f"| CPU of a rank's save_checkpoint | {med(rows['ray_ckpt']['cpu']):.3f} s | "
          f"{med(rows['verl']['cpu']):.3f} s | {med(rows['ray_ckpt']['cpu']) / med(rows['verl']['cpu']):.2f}x |")
    print(f"| CPU of a rank's load (2) | {med(cpu2['ray_ckpt']):.3f} s | {med(cpu2['verl']):.3f} s | "
          f"{med(cpu2['ray_ckpt']) / med(cpu2['verl']):.2f}x |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (CPU: the calling thread's, time.thread_time)")
    try:
        import ray_ckpt as rc

        rc.CheckpointEngine.connect(run).shutdown(stop_coordinator=True)
    except Exception:
        pass
    ray.shutdown()


if __name__ == "__main__":
    main()
