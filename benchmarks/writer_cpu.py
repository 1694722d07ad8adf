"""The critical writer's CPU per large save (issue 17): where it goes, user vs system.

    python benchmarks/writer_cpu.py [--mb 512] [--saves 8] [--dir DIR] [--overlap] [--hog] [--profile /tmp/w.raw]

Starts Ray (4 CPUs), one engine with one critical writer and no best-effort pool, and a provider
actor holding a model-like state of ``--mb`` MB (parameters and Adam's two moments, 8 float32
tensors of each, plus Adam's 8 scalar ``step`` tensors: 32 leaves, 24 of them large), then saves
``--saves`` times, each waited for (time to durable) before the next. Reported per save: the
writer processes' (command line contains ``WriterActor``) user and system CPU seconds and minor
page faults read from ``/proc/<pid>/stat`` before and after, and the median time to durable; and,
for comparison, what the idle writer (Ray's own threads) uses over the same wall time, watched
for ``--idle-s`` seconds before the saves. A first, unmeasured save warms the writer (imports,
first mapping of the object store). ``--hog``: an actor copies 256 MB back and forth on one
thread during the measured saves, taking memory bandwidth and cache as a learner's step would
(what ``overlap.py``'s writer competes with).

Why a separate script: ``overlap.py`` reports the writer's CPU as one number beside the learner's
loss; this one holds everything else still so a change in the writer shows up alone, and with
``--profile`` it runs ``py-spy record --native --format raw`` on the writer during the measured
saves and prints where its samples fell (self samples by innermost frame, and inclusive samples of
the frames that matter).

Which code runs: the ``ray_ckpt`` that this interpreter imports; Ray's workers inherit
``PYTHONPATH``, so ``PYTHONPATH=/tmp/old python benchmarks/writer_cpu.py`` measures another tree
(side by side A/B of a change).
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import ray
import torch

import ray_ckpt as rc


@ray.remote(num_cpus=0.5)
class Provider:
    """Parameters + Adam moments, ``mb`` MB in all (8 tensors per kind), all touched."""

    def __init__(self, mb: int):
        torch.manual_seed(0)
        n = mb * (1 << 20) // 4 // 3 // 8
        self.params = [torch.nn.Parameter(torch.randn(n)) for _ in range(8)]
        for p in self.params:
            p.grad = torch.randn(n) * 1e-3
        self.opt = torch.optim.Adam(self.params, lr=1e-4, foreach=False)
        self.opt.step()  # the moments exist: the state has its full size

    def ckpt_get_state(self, name):
        return {"model": {f"p{i}": p for i, p in enumerate(self.params)}, "optim": self.opt.state_dict()}

    def ckpt_set_state(self, name, state):
        raise NotImplementedError

    def where(self):
        return rc.__file__


@ray.remote(num_cpus=0.5)
class Hog:
    """A learner stand-in for ``--hog``: one thread copying 256 MB back and forth (memory bandwidth
    and last-level cache taken from the writer, as a training step's optimizer pass does)."""

    def __init__(self):
        import threading

        self.a, self.b = torch.randn(64 << 20), torch.empty(64 << 20)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        torch.set_num_threads(1)
        while not self.stop.is_set():
            self.b.copy_(self.a)
            self.a.copy_(self.b)

    def start(self):
        self.thread.start()

    def end(self):
        self.stop.set()
        self.thread.join()


def writer_stats() -> dict:
    """pid -> (user s, system s, minor faults) of the processes whose command line has WriterActor."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if b"WriterActor" not in f.read():
                    continue
            with open(f"/proc/{p}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(p)] = (int(st[11]) / tck, int(st[12]) / tck, int(st[7]))
    return out


def delta(before: dict, after: dict) -> tuple:
    u = s = flt = 0.0
    for pid, (au, as_, af) in after.items():
        bu, bs, bf = before.get(pid, (0.0, 0.0, 0))
        u, s, flt = u + au - bu, s + as_ - bs, flt + af - bf
    return u, s, flt


def summarise_raw(path: str, top: int = 25) -> None:
    """py-spy's raw (collapsed) stacks: 'frame;frame;... count' per line, outermost first."""
    self_n: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n)
            frames = [fr.split(" (")[0] for fr in stack.split(";")]
            total += n
            self_n[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    print(f"\npy-spy: {total} samples of the writer (idle threads included)")
    print(f"{'self %':>7}  innermost frame")
    for fr, n in self_n.most_common(top):
        print(f"{100 * n / total:7.1f}  {fr}")
    print(f"\n{'incl %':>7}  frame (inclusive)")
    for fr, n in incl.most_common(top * 2):
        print(f"{100 * n / total:7.1f}  {fr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--dir", default=None, help="local tier's parent directory (default: a temporary one)")
    ap.add_argument("--overlap", action="store_true", help="register with overlap=True")
    ap.add_argument("--profile", default=None, help="py-spy raw output file; profiles the writer")
    ap.add_argument("--hog", action="store_true", help="a memory-copying actor runs during the saves")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--idle-s", type=float, default=4.0,
                    help="seconds the idle writer is watched first (its background CPU over a save's time)")
    args = ap.parse_args()

    root = tempfile.mkdtemp(prefix="writer_cpu_", dir=args.dir)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        provider = Provider.remote(args.mb)
        where = ray.get(provider.where.remote())
        eng = rc.CheckpointEngine.create("writer-cpu", local_dir=root, critical_writers=1, best_effort_writers=0,
                                         keep_last=2)
        eng.register("learner", provider, strategy=rc.Strategy.CRITICAL, overlap=args.overlap)
        res = eng.save(0).wait(300)  # warm-up, not measured
        size = res.bytes_written
        pids = sorted(writer_stats())
        prof = None
        if args.profile and pids:
            prof = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record",
                                     "--pid", str(pids[0]), "--native", "--threads", "--format", "raw",
                                     "--rate", str(args.rate), "-o", args.profile],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attached
        idle0, t_idle = writer_stats(), time.perf_counter()
        time.sleep(args.idle_s)  # the writer's own background CPU (Ray's threads), for comparison
        iu, is_, _ = delta(idle0, writer_stats())
        idle_per_s = (iu + is_) / (time.perf_counter() - t_idle)
        hog = Hog.remote() if args.hog else None
        if hog is not None:
            ray.get(hog.start.remote())
        before = writer_stats()
        durable = []
        for step in range(1, args.saves + 1):
            t = time.perf_counter()
            eng.save(step).wait(300)
            durable.append(time.perf_counter() - t)
        u, s, flt = delta(before, writer_stats())
        if hog is not None:
            ray.get(hog.end.remote())
        if prof is not None:
            prof.send_signal(signal.SIGINT)
            try:
                prof.wait(60)
            except subprocess.TimeoutExpired:
                prof.kill()
        n = args.saves
        print(f"ray_ckpt from {where}")
        print(f"state {size / 2**20:.0f} MiB in one file, {n} saves, writer pids {pids}, "
              f"overlap={'on' if args.overlap else 'off'}, hog={'on' if args.hog else 'off'}")
        print(f"{'user s/save':>12} {'sys s/save':>11} {'cpu s/save':>11} {'minflt/save':>12} {'durable s (med)':>16} "
              f"{'idle cpu s/save':>16}")
        print(f"{u / n:12.3f} {s / n:11.3f} {(u + s) / n:11.3f} {flt / n:12.0f} {statistics.median(durable):16.3f} "
              f"{idle_per_s * sum(durable) / n:16.3f}")
        eng.shutdown()
        if prof is not None and os.path.exists(args.profile):
            summarise_raw(args.profile)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
