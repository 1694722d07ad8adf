"""Every GPU measurement of issue 17 in one short run: a learner with a 4 GB bf16 state on one CUDA
device (parameters + Adam's two moments), saved with ray_ckpt overlap on and off; per save, the
learner's pause (p50 / p99 / max, goal p99 <= 5 ms) and steps/s against the same steps without
checkpointing (goal >= 0.98x).

    python benchmarks/gpu_check.py                      # 4 GB bf16, 200 ms step, a save every 2 s
    python benchmarks/gpu_check.py --device cpu --gb 0.06 --steps 12   # dry run of the script itself
    python benchmarks/gpu_check.py --only verl --device cpu --verl-hidden 128 --verl-layers 2   # verl step, dry run
    python benchmarks/gpu_check.py --only deepspeed --device cpu --ds-hidden 128 --ds-layers 2   # DeepSpeed, dry run

The verl step (issue 28; needs the verl extra): verl's FSDP2 wrapping of a Qwen2 (~1.6 GB with AdamW
at the default size) saved by ``RayCkptCheckpointManager`` and by verl's ``FSDPCheckpointManager``,
reloaded by ours, bit-equal checked. The DeepSpeed step (issue 30; needs the openrlhf extra and
``pip install --no-deps openrlhf``): OpenRLHF's strategy on one rank at ZeRO-2 (a Qwen2 of ~1.6 GB
of fp32 masters, Adam moments and bf16 weights at the default size), ``save_ckpt`` of
``RayCkptDeepspeedStrategy`` against the stock one, reloaded by ours, bit-equal checked.

Without CUDA it prints why and exits with status 2, measuring nothing (the build VM has no GPU: the
CUDA path of the overlapped copy — pinned host buffers reused across saves, a side stream, the
fence as a stream wait — is written and tested on CPU only).

How the pause is measured: a step is ``--step-ms`` of forward/backward stand-in (bf16 matmuls on the
device) then ``opt.step()``, closed by ``torch.cuda.synchronize()`` so its wall time is what the
device did. The pause of a save = the time from the end of the step it follows to the end of the next
step (the snapshot call runs between the two, the fence inside ``opt.step``) - the median of the
same interval without checkpointing. ``--every-s`` of step time apart; local disk only (the writes of 4 GB
per save must fit the device's disk: ``keep_last=2``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import ray
import torch

import ray_ckpt as rc


class GpuLearner:
    def __init__(self, gb: float, step_ms: float, device: str):
        torch.manual_seed(0)
        self.device = torch.device(device)
        dtype = torch.bfloat16
        n = int(gb * (1 << 30)) // 2 // 3 // 8  # bf16: 2 bytes; params + 2 moments; 8 tensors each
        self.params = [torch.nn.Parameter(torch.randn(n, device=self.device, dtype=dtype)) for _ in range(8)]
        for p in self.params:
            p.grad = torch.randn(n, device=self.device, dtype=dtype) * 1e-3
        self.opt = torch.optim.Adam(self.params, lr=1e-4, foreach=True)
        self.opt.step()  # moments exist from the start: the state has its full size
        self.a = torch.randn(4096 if device != "cpu" else 256, 4096 if device != "cpu" else 256,
                             device=self.device, dtype=dtype)
        self.step_ms = step_ms
        self.times = []
        self.snap_s = []

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def ckpt_get_state(self, name):
        return {"model": {f"p{i}": p for i, p in enumerate(self.params)}, "optim": self.opt.state_dict()}

    def ckpt_set_state(self, name, state):
        raise NotImplementedError

    def step(self):
        t0 = time.perf_counter()
        deadline = t0 + self.step_ms / 1e3
        while time.perf_counter() < deadline:  # forward/backward stand-in on the device
            self.a @ self.a
            self._sync()
        self.opt.step()  # the overlapped save's fence (step pre-hook) runs here
        self._sync()
        self.times.append((t0, time.perf_counter()))

    def reset(self):
        from ray_ckpt.capture.overlap import process_copier

        self.times = []
        c = process_copier()
        if c is not None:
            c.history.clear(), c.fence_waits.clear(), c.call_s.clear()

    def result(self):
        from ray_ckpt.capture.overlap import process_copier

        c = process_copier()
        return {"times": self.times, "copies": list(c.history) if c else [],
                "fences": list(c.fence_waits) if c else [], "calls": list(c.call_s) if c else []}


def _intervals(times):
    """End of one step to the end of the next: the step, and whatever ran between (a snapshot call)."""
    return [b[1] - a[1] for a, b in zip(times, times[1:])]


def run(learner, steps, every, save):
    ray.get(learner.reset.remote())
    refs, calls = [], []
    for i in range(1, steps + 1):
        refs.append(learner.step.remote())
        if every and i % every == 0 and i < steps:
            t = time.perf_counter()
            calls.append((i, save(i), t))
    ray.get(refs)
    return ray.get(learner.result.remote()), calls


def _report(title, stock, save, load, times, want, got) -> bool:
    """Print a framework step's table (ours vs the stock save, a durable version, the load) and
    whether every tensor came back bit-equal; returns that."""
    block, durable, load_s, stock_s = times
    same = want.keys() == got.keys() and all(torch.equal(want[k].view(torch.uint8), got[k].view(torch.uint8))
                                             for k in want)
    print(title)
    print(f"| what | ray_ckpt | {stock} | ratio |")
    print(f"| {save} blocks the rank, s | {block:.3f} | {stock_s:.3f} | {block / stock_s:.3f}x |")
    print(f"| save to a durable version, s | {durable:.3f} | {stock_s:.3f} (no fsync) | {durable / stock_s:.3f}x |")
    print(f"| {load} (same world size), s | {load_s:.3f} | - | - |")
    print(f"bit-equal after load: {'yes' if same else 'NO'}")
    return same


def verl_step(device: str, hidden: int, layers: int) -> None:
    """verl's FSDP2 wrapping (``apply_fsdp2``) of a Qwen2 on ``device`` (one rank: NCCL on CUDA, gloo
    on CPU), saved by ``RayCkptCheckpointManager`` and by verl's own ``FSDPCheckpointManager``, then
    loaded by ours into a model of another seed: how long each save blocks the rank, the time to a
    committed version, the load, and whether every parameter and AdamW moment came back bit-equal
    (CUDA DTensors pushed through pinned host staging)."""
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, Qwen2Config
    from verl.trainer.config import CheckpointConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    from ray_ckpt.integrations.verl import RayCkptCheckpointManager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (1,), mesh_dim_names=("fsdp",))
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    root = tempfile.mkdtemp(prefix="gpu-check-verl-")
    ckpt = omega_conf_to_dataclass(OmegaConf.create({
        "_target_": "ray_ckpt.integrations.verl.RayCkptCheckpointConfig",
        "save_contents": ["model", "optimizer", "extra"], "load_contents": ["model", "optimizer", "extra"],
        "ray_ckpt": {"run": f"gpuverl{int(time.time()) % 10**6}", "local_dir": os.path.join(root, "ckpt"),
                     "critical_writers": 1, "best_effort_writers": 0}}))

    def build(seed):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg).to(device)
        apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": True}, {})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return model, opt

    def full(model, opt):
        out = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
        for i, st in enumerate(opt.state.values()):
            out.update({f"opt{i}.{k}": st[k].full_tensor().cpu() for k in ("exp_avg", "exp_avg_sq")})
        return out

    model, opt = build(0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    ours = RayCkptCheckpointManager(model=model, optimizer=opt, lr_scheduler=None, processing_class=None,
                                    checkpoint_config=ckpt)
    ours.save_checkpoint(os.path.join(root, "trainer", "global_step_1", "actor"), None, global_step=1)
    ours.wait_until_finished(timeout=600)  # the first save creates the run: not timed
    path = os.path.join(root, "trainer", "global_step_2", "actor")
    t0 = time.perf_counter()
    ours.save_checkpoint(path, None, global_step=2)
    block = time.perf_counter() - t0
    ours.wait_until_finished(timeout=600)
    committed = time.perf_counter() - t0
    stock = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None, processing_class=None,
                                  checkpoint_config=CheckpointConfig())
    t0 = time.perf_counter()
    stock.save_checkpoint(os.path.join(root, "stock", "global_step_1", "actor"), None, global_step=1)
    stock_s = time.perf_counter() - t0
    want = full(model, opt)
    fresh, fresh_opt = build(1)
    loader = RayCkptCheckpointManager(model=fresh, optimizer=fresh_opt, lr_scheduler=None, processing_class=None,
                                      checkpoint_config=ckpt)
    t0 = time.perf_counter()
    loader.load_checkpoint(path)
    load_s = time.perf_counter() - t0
    got = full(fresh, fresh_opt)
    same = _report(f"verl step on {device}: Qwen2 hidden {hidden} x {layers} layers, {nbytes / 2**30:.2f} GiB "
                   f"(params + AdamW moments)", "verl FSDPCheckpointManager", "save_checkpoint",
                   "load_checkpoint", (block, committed, load_s, stock_s), want, got)
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    if not same:
        sys.exit(1)


def deepspeed_step(device: str, hidden: int, layers: int, stage: int) -> None:
    """OpenRLHF's ``DeepspeedStrategy`` (one rank: NCCL on CUDA, gloo on CPU) with a Qwen2 at ZeRO
    ``stage``: ``save_ckpt`` of ``RayCkptDeepspeedStrategy`` against the stock one (how long each
    blocks the rank, the time to a durable version), then ``load_ckpt`` of ours into a model of
    another seed and whether the fp32 masters, both Adam moments and the 16-bit weights came back
    bit-equal (gathered with DeepSpeed's own calls). Torch's AdamW (``torch_adam``) on both, so that
    nothing is compiled on the machine."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
    from ray_ckpt.integrations.openrlhf import cpu

    cpu.prepare()  # flash_attn stubbed where it is not installed; the CPU-only parts only without CUDA
    from types import SimpleNamespace as NS

    from deepspeed.runtime.zero import GatheredParameters
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from transformers import AutoModelForCausalLM, Qwen2Config

    from ray_ckpt.integrations.openrlhf import RayCkptDeepspeedStrategy

    root = tempfile.mkdtemp(prefix="gpu-check-ds-")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    cfg = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="eager")
    optim = {"optim": "adam", "adam": {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01},
             "lr_scheduler": "cosine_with_min_lr", "lr_warmup_ratio": 0.1, "scheduler_steps": 20, "max_norm": 1.0}
    run = f"gpuds{int(time.time()) % 10**6}"

    def build(cls, seed, ray_ckpt=None):
        args = NS(local_rank=-1, ds=NS(param_dtype="bf16"), train=NS(dynamic_batch_enable=False))
        if ray_ckpt is not None:
            args.ray_ckpt = NS(**ray_ckpt)
        strategy = cpu.torch_adam(cls)(seed=seed, micro_train_batch_size=1, train_batch_size=1, zero_stage=stage,
                                       args=args)
        if device.startswith("cuda"):
            strategy.setup_distributed()
        else:
            cpu.setup_distributed(strategy, 0, 1, 29533)
        torch.manual_seed(seed)
        model, opt, sched = strategy.prepare((AutoModelForCausalLM.from_config(cfg), dict(optim)))
        tokens = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed))
        tokens = tokens.to(torch.cuda.current_device() if device.startswith("cuda") else "cpu")
        strategy.backward(model(input_ids=tokens, labels=tokens).loss, model, opt)
        strategy.optimizer_step(opt, model, sched)
        return strategy, model

    def full(model):
        opt = model.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-1/2 link the moments lazily
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
        out = {}
        for name, p in model.module.named_parameters():
            out[f"fp32/{name}"] = safe_get_full_fp32_param(p).cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).cpu().clone()
            with GatheredParameters([p]):
                out[f"lp/{name}"] = p.data.detach().cpu().clone()
        return out

    settings = {"run": run, "local_dir": os.path.join(root, "ckpt"), "critical_writers": 1, "best_effort_writers": 0}
    ours, model = build(RayCkptDeepspeedStrategy, 0, settings)
    nbytes = sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters()) * (4 * 3 + 2)
    ours.save_ckpt(model, os.path.join(root, "ours"), "global_step1")  # creates the run: not timed
    ours.wait_until_finished(timeout=600)
    t0 = time.perf_counter()
    ours.save_ckpt(model, os.path.join(root, "ours"), "global_step2")
    block = time.perf_counter() - t0
    ours.wait_until_finished(timeout=600)
    durable = time.perf_counter() - t0
    stock = DeepspeedStrategy.__new__(DeepspeedStrategy)  # the stock save_ckpt on the same engine
    stock.__dict__.update({k: v for k, v in ours.__dict__.items() if not k.startswith("_")})
    t0 = time.perf_counter()
    DeepspeedStrategy.save_ckpt(stock, model, os.path.join(root, "stock"), "global_step2")
    stock_s = time.perf_counter() - t0
    want = full(model)
    fresh_strategy, fresh = build(RayCkptDeepspeedStrategy, 1, settings)
    t0 = time.perf_counter()
    fresh_strategy.load_ckpt(fresh, os.path.join(root, "ours"))
    load_s = time.perf_counter() - t0
    got = full(fresh)
    same = _report(f"deepspeed step on {device}: ZeRO-{stage}, Qwen2 hidden {hidden} x {layers} layers, "
                   f"{nbytes / 2**30:.2f} GiB (fp32 masters + Adam moments + bf16 weights)",
                   "OpenRLHF stock save_ckpt", "save_ckpt", "load_ckpt", (block, durable, load_s, stock_s), want, got)
    fresh_strategy.wait_until_finished(timeout=60)
    import torch.distributed as dist

    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)
    if not same:
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--step-ms", type=float, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every-s", type=float, default=2.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", choices=("overlap", "verl", "deepspeed"), help="run one step (default: all three)")
    ap.add_argument("--verl-hidden", type=int, default=2048, help="verl step: Qwen2 hidden size")
    ap.add_argument("--verl-layers", type=int, default=16, help="verl step: Qwen2 layers")
    ap.add_argument("--ds-hidden", type=int, default=2048, help="deepspeed step: Qwen2 hidden size")
    ap.add_argument("--ds-layers", type=int, default=8, help="deepspeed step: Qwen2 layers")
    ap.add_argument("--ds-stage", type=int, default=2, choices=(1, 2, 3), help="deepspeed step: ZeRO stage")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}): nothing measured. Run it on a machine with a GPU; "
              "`--device cpu --gb 0.06` is a dry run of the script.", file=sys.stderr)
        sys.exit(2)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "4"}})
    if args.only in (None, "verl"):
        verl_step(args.device, args.verl_hidden, args.verl_layers)
    if args.only in (None, "deepspeed"):
        deepspeed_step(args.device, args.ds_hidden, args.ds_layers, args.ds_stage)
    if args.only in ("verl", "deepspeed"):
        ray.shutdown()
        return
    gpus = 1 if args.device.startswith("cuda") else 0
    learner = ray.remote(num_gpus=gpus, num_cpus=1)(GpuLearner).remote(args.gb, args.step_ms, args.device)
    ray.get(learner.reset.remote())
    base, _ = run(learner, args.steps, 0, None)
    base_steps = [b - a for a, b in base["times"]]
    base_med = statistics.median(base_steps)
    base_gap = statistics.median(_intervals(base["times"]))
    base_rate = len(base_steps) / (base["times"][-1][1] - base["times"][0][0])
    every = max(1, round(args.every_s / base_med))
    name = torch.cuda.get_device_name() if gpus else "cpu"
    print(f"{name}: {args.gb:g} GB bf16 state, {args.step_ms:g} ms step + opt.step (median step "
          f"{base_med * 1e3:.1f} ms), a save every {every} steps, {args.steps} steps; no checkpointing "
          f"{base_rate:.2f} steps/s")
    root = tempfile.mkdtemp(prefix="gpu-check-")
    print("| contender | pause p50 ms | p99 ms | max ms | steps/s | vs none | fence waits ms (sum) | "
          "snapshot call ms (max) | copy ms (median) |")
    for overlap in (True, False):
        run_name = f"gpu{int(overlap)}x{int(time.time()) % 10**6}"
        eng = rc.CheckpointEngine.create(run_name, local_dir=os.path.join(root, run_name), critical_writers=1,
                                         best_effort_writers=0, overlap=overlap, keep_last=2, max_in_flight=2)
        eng.register("state", learner)
        time.sleep(2.0)  # register() maps the needed object-store pages in the background
        handles = []

        def save(i):
            h = eng.save(i, on_busy="skip")
            handles.append(h)
            return h
        res, calls = run(learner, args.steps, every, save)
        for h in handles:
            if not h.skipped:
                h.wait(600)
        gaps = _intervals(res["times"])  # gaps[i-1]: end of step i to end of step i+1 (save i between)
        rate = len(res["times"]) / (res["times"][-1][1] - res["times"][0][0])
        after = [i for i, h, _ in calls if not h.skipped]
        pauses = sorted(max(0.0, gaps[i - 1] - base_gap) * 1e3 for i in after if i - 1 < len(gaps))
        pauses = pauses or [0.0]
        p99 = pauses[min(len(pauses) - 1, int(round(0.99 * (len(pauses) - 1))))]
        copies = [c[3] * 1e3 for c in res["copies"]]
        print(f"| ray_ckpt overlap={'on' if overlap else 'off'} | {statistics.median(pauses):.1f} | {p99:.1f} | "
              f"{pauses[-1]:.1f} | {rate:.2f} | {rate / base_rate:.3f} | {sum(res['fences']) * 1e3:.1f} | "
              f"{max(res['calls'], default=0) * 1e3:.1f} | {statistics.median(copies) if copies else float('nan'):.0f} |")
        eng.shutdown()
        shutil.rmtree(os.path.join(root, run_name), ignore_errors=True)
    print("goals: pause p99 <= 5 ms, steps/s >= 0.98x (overlap=on row)")
    shutil.rmtree(root, ignore_errors=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
