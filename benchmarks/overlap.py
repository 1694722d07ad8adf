"""Overlapped snapshots (issue 17): learner pause per save, steps/s against no checkpointing and
time to durable, side by side in one run: ray_ckpt with overlap, ray_ckpt without, torch DCP
``async_save`` with ``DefaultStager`` (staging awaited before the optimizer step, as torchtitan
does), ``torch.save`` (blocking) and a floor (the least a background checkpoint can do: one memcpy on
a niced thread, fenced before the optimizer step, then one O_DIRECT write; no Ray, no checksum), for
a learner whose step is longer than one copy of its state and one whose step is shorter; and the
first save of fresh learners against their tenth.

    python benchmarks/overlap.py [--configs 512:200,512:1000,64:20] [--steps 16] [--every-s 0.5] [--dir DIR]
                                 [--first-mb 256] [--first-learners 3]     (--configs "": first saves only)

The learner is a Ray actor with a model-like state (parameters + Adam's two moments, ``MB`` in all,
in 8 tensors per kind) and a real ``torch.optim.Adam``; a step is ``STEP_MS`` of forward/backward
compute (a matmul loop, one thread) followed by ``opt.step()``, which takes what it takes (Adam over
512 MB of state: 250-450 ms on the build VM). The fence of an overlapped save is the optimizer's
step pre-hook, so the copy has the ``STEP_MS`` of compute to finish in. (Until 2026-11-30 the
compute was ``STEP_MS`` minus the optimizer step's time, which for 512 MB was no compute at all:
the fence came right after the snapshot and waited for the whole copy.) The driver queues the steps
(and a save every ``--every-s`` seconds of measured step time, at least one step apart) ahead, so
the learner is never idle waiting for the driver.

Columns (per configuration and contender):
  lost ms      the learner's time lost per save: (wall time of the run - the same steps' wall time
               without checkpointing) / saves; it includes the CPU the writers take from the
               learner on a small machine, not only the snapshot
  in-learner   measured inside the learner, per save: ray_ckpt overlap=on: the snapshot call
               (views + queueing the copy) + the fences' waits (the learner's whole pause);
               DCP: the async_save call (its staging wait before opt.step is in "lost");
               torch.save: the call (+fsync)
  x memcpy     lost ms over one memcpy of the state (copy_ into a preallocated, touched tensor)
  steps/s      steps per second of the run, and as a fraction of the run without checkpointing
  durable s    median of save() until the version is committed (files fsynced, manifest written)
  copy ms      ray_ckpt overlap=on: median time of the background copy into the object store
               (the fence waits only if it is longer than the step's compute)
  writer cpu   CPU seconds per save of the checkpoint writer processes (ray_ckpt rows)
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


@ray.remote(num_cpus=0.5)
class Learner:
    def __init__(self, mb: int, step_ms: float):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        n = mb * (1 << 20) // 4 // 3 // 8
        self.params = [torch.nn.Parameter(torch.randn(n)) for _ in range(8)]
        for p in self.params:
            p.grad = torch.randn(n) * 1e-3
        self.opt = torch.optim.Adam(self.params, lr=1e-4, foreach=False)
        self.opt.step()  # moments exist from the start: the state has its full size
        self.step_ms = step_ms
        a = torch.randn(256, 256)
        t = time.perf_counter()
        for _ in range(20):
            a @ a
        self.mm_s = (time.perf_counter() - t) / 20
        self.a = a
        self.times = []  # (start, end) of each step
        self.snapshot_s = []
        self.dcp = None
        self.torch_save_dir = None
        dst = torch.zeros(sum(p.numel() for p in self.params) * 3)  # touched: no page faults in the copy
        src = torch.cat([p.detach() for p in self.params] * 3)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t)
        self.memcpy_s = min(ts)
        del dst, src

    def ckpt_get_state(self, name):
        return {"model": {f"p{i}": p for i, p in enumerate(self.params)}, "optim": self.opt.state_dict()}

    def ckpt_set_state(self, name, state):
        raise NotImplementedError

    def info(self):
        return {"memcpy_s": self.memcpy_s, "mm_s": self.mm_s}

    def reset(self):
        self.times = []
        from ray_ckpt.capture.overlap import process_copier

        c = process_copier()
        if c is not None:
            c.fence_waits.clear()
            c.history.clear()
            c.call_s.clear()

    def step(self, baseline_fence=None):
        t0 = time.perf_counter()
        deadline = t0 + self.step_ms / 1e3  # forward/backward: STEP_MS of compute before the optimizer step
        while time.perf_counter() < deadline:  # forward/backward stand-in: compute, GIL released
            self.a @ self.a
        if getattr(self, "floor", None) is not None:  # the floor's fence: its copy is done
            self.floor["copied"].wait()
        if self.dcp is not None:  # DCP's rule: staging must be complete before the state changes
            fut = self.dcp[0]
            if fut is not None:
                fut.staging_completion.result()
        self.opt.step()
        self.times.append((t0, time.perf_counter()))

    def opt_s_estimate(self):
        return getattr(self, "_opt_s", 0.0)

    def calibrate(self):
        t = time.perf_counter()
        self.opt.step()
        self._opt_s = time.perf_counter() - t
        return self._opt_s

    # ---- in-learner contenders
    def dcp_save(self, path):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29541")
            dist.init_process_group("gloo", rank=0, world_size=1)
        if self.dcp is None:
            from torch.distributed.checkpoint.staging import StagingOptions

            # pinned host memory needs CUDA; the rest of DefaultStager's defaults (async staging)
            opts = StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                  use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available())
            self.dcp = [None, DefaultStager(opts), []]
        t = time.perf_counter()
        resp = dcp.async_save(self.ckpt_get_state("s"), checkpoint_id=path, async_stager=self.dcp[1])
        self.dcp[0] = resp
        self.dcp[2].append((t, resp))
        self.snapshot_s.append(time.perf_counter() - t)

    def dcp_durable(self):
        out = []
        for t, resp in self.dcp[2]:
            resp.upload_completion.result()
            out.append(None)
        self.dcp[2] = []
        return out

    def floor_save(self, path):
        """The least a background checkpoint can do: one memcpy of the state into a reused, touched
        buffer on a niced thread (fenced before opt.step like ours), then one O_DIRECT write of it
        and an fsync; no Ray, no checksum, no manifest. What it costs the learner is this VM's floor."""
        import mmap
        import threading

        import numpy as np

        t = time.perf_counter()
        if getattr(self, "floor", None) is None:
            tensors = [p.detach() for p in self.params]
            for st in self.opt.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
            n = sum(x.numel() * x.element_size() for x in tensors)
            n = (n + (1 << 23) - 1) // (1 << 23) * (1 << 23)
            buf = mmap.mmap(-1, n)
            dst = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
            dst.fill_(1)  # touched: no page faults in the copies
            self.floor = {"buf": buf, "dst": dst, "tensors": tensors, "copied": threading.Event(),
                          "done": threading.Event(), "durable": []}
            self.floor["copied"].set()
            self.floor["done"].set()
        fl = self.floor
        fl["done"].wait()  # one save at a time, like overlap's copy of the same state
        fl["copied"].clear()
        fl["done"].clear()

        def work(t0=t):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            off = 0
            for x in fl["tensors"]:
                b = x.numel() * x.element_size()
                fl["dst"][off:off + b].copy_(x.view(-1).view(torch.uint8))
                off += b
            fl["copied"].set()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                view = memoryview(fl["buf"])
                for i in range(0, len(view), 1 << 23):
                    os.write(fd, view[i:i + (1 << 23)])
                os.fsync(fd)
            finally:
                os.close(fd)
            fl["durable"].append(time.perf_counter() - t0)
            fl["done"].set()
        threading.Thread(target=work, daemon=True).start()
        self.snapshot_s.append(time.perf_counter() - t)

    def floor_durable(self):
        self.floor["done"].wait()
        out, self.floor["durable"] = self.floor["durable"], []
        return out

    def torch_save(self, path):
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.ckpt_get_state("s"), f)
            f.flush()
            os.fsync(f.fileno())
        self.snapshot_s.append(time.perf_counter() - t)
        return time.perf_counter() - t

    def stats(self):
        from ray_ckpt.capture.overlap import process_copier

        c = process_copier()
        waits = list(c.fence_waits) if c is not None else []
        copies = list(c.history) if c is not None else []
        calls = list(c.call_s) if c is not None else []
        out = {"times": self.times, "fence": waits, "snap": self.snapshot_s, "copies": copies, "calls": calls}
        self.snapshot_s = []
        return out

    def pid(self):
        return os.getpid()


def run_loop(learner, steps, every, on_save):
    """Queue ``steps`` steps with ``on_save(i)`` after every ``every``-th; returns (wall s, saves)."""
    ray.get(learner.reset.remote())
    saves = []
    refs = []
    for i in range(1, steps + 1):
        refs.append(learner.step.remote())
        if every and i % every == 0 and i < steps:
            saves.append(on_save(i))
    ray.get(refs)
    st = ray.get(learner.stats.remote())
    times = st["times"]
    return times[-1][1] - times[0][0], saves, st


def _cpu_by(pattern):
    """CPU seconds used so far by the processes whose command line contains ``pattern``."""
    total = 0.0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if pattern not in f.read():
                    continue
            with open(f"/proc/{p}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK")
    return total


def bench_config(mb, step_ms, steps, every_s, root, first_vs_tenth):
    learner = Learner.remote(mb, step_ms)
    info = ray.get(learner.info.remote())
    ray.get(learner.calibrate.remote())
    rows = []
    base_wall, _, _ = run_loop(learner, steps, 0, None)
    base_rate = steps / base_wall
    every = max(1, round(every_s * base_rate))
    memcpy_ms = info["memcpy_s"] * 1e3

    def row(name, wall, nsaves, inner_ms, durable, copy_ms=None, writer_cpu=None):
        pause = max(0.0, (wall - base_wall) * 1e3 / max(nsaves, 1))
        rows.append((name, pause, inner_ms, pause / memcpy_ms, steps / wall, steps / wall / base_rate, durable,
                     copy_ms, writer_cpu))

    for overlap in (True, False):
        run = f"ov{'1' if overlap else '0'}{mb}x{int(time.time() * 1e3) % 10**8}"
        eng = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, run), critical_writers=1,
                                         best_effort_writers=0, overlap=overlap, max_in_flight=4)
        eng.register("state", learner)
        time.sleep(1.0)  # the needed-pages prefault of register() runs in the background
        handles = []
        t_save = {}

        def save(i):
            t_save[i] = time.perf_counter()
            h = eng.save(i, on_busy="queue")
            handles.append(h)
            return h
        cpu0 = _cpu_by(b"WriterActor")
        wall, _, st = run_loop(learner, steps, every, save)
        for h in handles:
            h.wait(300)
        writer_cpu = (_cpu_by(b"WriterActor") - cpu0) / max(len(handles), 1)
        # in the learner, per save: the snapshot call + the fences' waits
        inner = (sum(st["fence"]) + sum(st["calls"])) * 1e3 / max(len(handles), 1)
        copies = [c[3] * 1e3 for c in st["copies"][-len(handles):]] if overlap else []
        # time to durable: save() call to commit, measured by waiting on each handle in turn
        durable_s = _durable_one(eng, learner, steps + 1)
        row(f"ray_ckpt overlap={'on' if overlap else 'off'}", wall, len(handles),
            inner if overlap else None, durable_s, statistics.median(copies) if copies else None, writer_cpu)
        eng.shutdown()
        shutil.rmtree(os.path.join(root, run), ignore_errors=True)
        ray.get(learner.reset.remote())

    # torch DCP async_save with DefaultStager
    try:
        paths = []

        def dcp_save(i):
            p = os.path.join(root, f"dcp{mb}_{i}")
            paths.append(p)
            return learner.dcp_save.remote(p)
        wall, saves, st = run_loop(learner, steps, every, dcp_save)
        ray.get(saves)
        ray.get(learner.dcp_durable.remote())
        row("torch DCP async_save + DefaultStager", wall, len(saves), statistics.median(st["snap"]) * 1e3, None)
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
    except Exception as exc:
        print(f"  (DCP unavailable: {type(exc).__name__}: {exc})", file=sys.stderr)

    def floor_save(i):
        return learner.floor_save.remote(os.path.join(root, f"floor{mb}_{i}.bin"))
    wall, saves, st = run_loop(learner, steps, every, floor_save)
    ray.get(saves)
    durs = ray.get(learner.floor_durable.remote())
    row("floor: memcpy + O_DIRECT write, no Ray", wall, len(saves), statistics.median(st["snap"]) * 1e3,
        statistics.median(durs) if durs else None)

    def ts_save(i):
        return learner.torch_save.remote(os.path.join(root, f"ts{mb}_{i}.pt"))
    wall, saves, st = run_loop(learner, steps, every, ts_save)
    durs = ray.get(saves)
    row("torch.save (+fsync, blocking)", wall, len(saves), statistics.median(st["snap"]) * 1e3,
        statistics.median(durs))
    for f in os.listdir(root):
        if f.startswith(("ts", "floor")):
            os.remove(os.path.join(root, f))
    ray.kill(learner)
    return rows, memcpy_ms, base_rate, every


def _durable_one(eng, learner, step):
    """One more save on an idle learner: save() until its local commit."""
    t = time.perf_counter()
    eng.save(step).wait(300)
    return time.perf_counter() - t


def first_vs_tenth(mb, root, overlap):
    """A fresh learner (new process) saves 10 times, idle between saves: each save's learner pause
    (save() until a no-op call queued behind the snapshot returns) — the first against the tenth."""
    learner = Learner.remote(mb, 10)
    ray.get(learner.info.remote())
    run = f"ft{mb}x{int(time.time() * 1e3) % 10**8}"
    eng = rc.CheckpointEngine.create(run, local_dir=os.path.join(root, run), critical_writers=1,
                                     best_effort_writers=0, overlap=overlap)
    eng.register("state", learner)
    time.sleep(2.0)  # register() maps the needed pages in the background
    pauses = []
    for i in range(1, 11):
        ray.get(learner.pid.remote())
        t = time.perf_counter()
        h = eng.save(i)
        ray.get(learner.pid.remote())  # runs once the snapshot call returned
        pauses.append((time.perf_counter() - t) * 1e3)
        h.wait(300)
    eng.shutdown()
    shutil.rmtree(os.path.join(root, run), ignore_errors=True)
    ray.kill(learner)
    return pauses


def table(header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |", line]
    for r in rows:
        out.append("| " + " | ".join(str(x).rjust(w) for x, w in zip(r, widths)) + " |")
    out.append(line)
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="512:200,512:1000,64:20", help="MB:step_ms,...")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every-s", type=float, default=0.5)
    ap.add_argument("--first-mb", type=int, default=256)
    ap.add_argument("--first-learners", type=int, default=3, help="fresh learners per first-vs-tenth row")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="overlap-bench-")
    os.makedirs(root, exist_ok=True)
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    print(f"machine: {os.cpu_count()} cores; torch {torch.__version__}; ray {ray.__version__}; dir {root}")
    for spec in filter(None, args.configs.split(",")):
        mb, step_ms = (int(x) for x in spec.split(":"))
        steps = args.steps if step_ms >= 100 else args.steps * 5
        rows, memcpy_ms, base_rate, every = bench_config(mb, step_ms, steps, args.every_s, root, None)
        print(f"\n{mb} MB state, {step_ms} ms compute + opt.step, a save every {every} steps, {steps} steps; "
              f"one memcpy {memcpy_ms:.1f} ms; no checkpointing {base_rate:.2f} steps/s")
        fmt = [(n, f"{p:.1f}", "-" if i is None else f"{i:.1f}", f"{x:.2f}", f"{r:.2f}", f"{f:.3f}",
                "-" if d is None else f"{d:.2f}", "-" if c is None else f"{c:.0f}", "-" if w is None else f"{w:.2f}")
               for n, p, i, x, r, f, d, c, w in rows]
        print(table(["contender", "lost ms/save", "in-learner ms/save", "x memcpy", "steps/s", "vs none",
                     "durable s", "copy ms", "writer cpu s/save"], fmt))
    for overlap in ((False, True) if args.first_learners else ()):
        runs = [first_vs_tenth(args.first_mb, root, overlap) for _ in range(args.first_learners)]
        first, tenth = statistics.median(r[0] for r in runs), statistics.median(r[-1] for r in runs)
        later = statistics.median(x for r in runs for x in r[1:])
        print(f"\nfresh learner, {args.first_mb} MB, overlap={'on' if overlap else 'off'}, "
              f"{args.first_learners} learners: pause per save ms")
        for r in runs:
            print("  " + " ".join(f"{x:.0f}" for x in r))
        print(f"  median first {first:.1f}, tenth {tenth:.1f}, saves 2-10 {later:.1f}: first/tenth = "
              f"{first / tenth:.2f}, first/median(2-10) = {first / later:.2f}")
    ray.shutdown()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
