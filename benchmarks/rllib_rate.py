"""RLlib: train()'s rate with a save every iteration whose background work overlaps training, the
arms side by side in time.

    python benchmarks/rllib_rate.py [--config dqn|ppo0|ppo1] [--blocks 8] [--block 5] [--prefill 30000] [--clone]

Why a benchmark of its own: on a shared 2-core VM the same process can run 1.6x slower one
minute than the next (measured: DQN's no-save arm 0.557 s then 0.894 s per iteration, run
alone twice in a row), so arms run one after the other compare the minutes, not the arms; and
arms interleaved in one process (``rllib_iteration.py``) put one arm's writers' work on the next
arm's iteration. Here each arm is a process of its own with its own Ray cluster (its own garbage
collector too), both alive for the whole run; they take turns in blocks of ``--block``
iterations, in the order A B B A A B B A ... (a drift over the run falls on both alike), and
never run at the same time. The ``ray_ckpt`` arm (the callback, a save every iteration,
``on_busy="queue"``) does not wait for its versions inside a block -- the writers, the
coordinator and the copy thread run beside its next iterations on the same cores, as in a user's
run -- and at the end of its block it waits for them, timed: that drain is the work its last
iteration left, counted in its block's time. The ``rllib_save`` arm is the peer: RLlib's own
``algo.save_to_path()`` after every ``train()``, synchronous, timed with the iteration (its bytes:
one checkpoint directory).

Printed per arm: train() median and mean, each block's seconds (its iterations plus the drain), CPU
seconds per iteration of the arm's whole process tree (driver, raylet, GCS, coordinator, writers,
env runners: everything its run costs), and the rate against ``none`` two ways: total over total,
and the median over block pairs of neighbouring blocks (the drift between two blocks is smaller
than over the run). The goal of issue 26 is >= 0.97x.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _tree_cpu() -> dict:
    """CPU seconds of this process and of every process it started (its local Ray cluster), by pid:
    (what the process is, seconds)."""
    import psutil

    me = psutil.Process()
    out = {}
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            out[p.pid] = (_what(p, me), t.user + t.system)
        except psutil.Error:
            pass
    return out


def _what(p, me) -> str:
    """A Ray process by its role: ``ray::CheckpointCoordinator.save`` -> CheckpointCoordinator."""
    if p.pid == me.pid:
        return "driver"
    cmd = " ".join(p.cmdline())
    if "ray::" in cmd:
        return cmd.split("ray::", 1)[1].split()[0].split(".")[0] or "worker"
    return os.path.basename(p.cmdline()[0]) if p.cmdline() else p.name()


def _cpu_since(before: dict, after: dict) -> dict:
    """CPU seconds by role between two ``_tree_cpu`` readings (a process that ended meanwhile is left
    out; one that started counts from 0)."""
    out: dict = {}
    for pid, (what, s) in after.items():
        s0 = before.get(pid, (what, 0.0))[1]
        out[what] = out.get(what, 0.0) + max(0.0, s - s0)
    return out


def _child(arm: str, config: str, prefill_steps: int, clone: bool = False) -> None:
    """One arm: build, prefill, warm up, then run blocks of iterations as the parent says."""
    import ray

    import rllib_iteration as bench
    from ray_ckpt.integrations import rllib as rr

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    make = {"dqn": bench.dqn_config, "ppo0": lambda: bench.ppo_config(0),
            "ppo1": lambda: bench.ppo_config(1)}[config]
    cfg = make()
    if arm.startswith("ray_ckpt"):
        options = {"critical_writers": 1, "best_effort_writers": 1}
        if arm == "ray_ckpt_nice0":  # the coordinator, mailbox and writers at training's priority
            options.update(critical_nice=0, best_effort_nice=0)
        if arm == "ray_ckpt_mailbox":  # the learner's small states copied in the background, as before
            from ray_ckpt.capture import calls

            calls.OVERLAP_MIN_BYTES = 0
        cfg = cfg.callbacks(rr.make_callback("rllib-rate", local_dir=tempfile.mkdtemp(prefix="rllib_rate_"), every=1,
                                             on_busy="queue", engine_options=options))
    algo = cfg.build_algo()
    if config == "dqn":
        bench.prefill(algo, prefill_steps, clone)
    for _ in range(3):  # warm-up: the first save writes the whole buffer; the writers import what they need
        algo.train()
        if arm.startswith("ray_ckpt"):
            rr.wait_for_saves(algo, timeout=600)
    rllib_dir, saved = tempfile.mkdtemp(prefix="rllib_rate_own_"), 0
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "stop":
            break
        n = int(cmd[1])
        cpu0, times = _tree_cpu(), []
        t_block = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            algo.train()
            if arm == "rllib_save":  # RLlib's own checkpoint, synchronous, as its users call it
                saved += 1
                algo.save_to_path(os.path.join(rllib_dir, f"it{saved}"))
            times.append(time.perf_counter() - t0)
            if arm == "rllib_save" and saved > 1:  # the disk holds the newest one only (untimed)
                shutil.rmtree(os.path.join(rllib_dir, f"it{saved - 1}"), ignore_errors=True)
        drain = 0.0
        if arm.startswith("ray_ckpt"):
            t0 = time.perf_counter()
            rr.wait_for_saves(algo, timeout=600)
            drain = time.perf_counter() - t0
        block_s = time.perf_counter() - t_block
        cpu = _cpu_since(cpu0, _tree_cpu())
        print("BLOCK " + json.dumps({"times": times, "drain": drain, "block_s": block_s,
                                     "cpu": sum(cpu.values()), "by_role": cpu}), flush=True)
    out = {}
    if arm == "rllib_save":
        out["bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(rllib_dir) for f in fs)
        shutil.rmtree(rllib_dir, ignore_errors=True)
    cb = rr.find_callback(algo)
    if cb is not None:
        out["save_ms"] = statistics.median(cb.save_call_ms[3:]) if cb.save_call_ms[3:] else None
        results = rr.wait_for_saves(algo, timeout=600)
        sizes = [r.bytes_written for it, r in sorted(results.items())][3:]  # after the warm-up's
        out["bytes"] = statistics.median(sizes) if sizes else None
        if config == "dqn":
            out["rows"] = len(algo.local_replay_buffer)
    algo.stop()
    ray.shutdown()
    print("DONE " + json.dumps(out), flush=True)


def _read(proc, prefix: str, err=None) -> dict:
    for line in proc.stdout:
        if line.startswith(prefix):
            rest = line[len(prefix):].strip()
            return json.loads(rest) if rest else {}
    tail = ""
    if err is not None:
        err.seek(0)
        tail = err.read()[-3000:]
    raise SystemExit(f"an arm ended before {prefix.strip()!r}:\n{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="dqn", choices=["dqn", "ppo0", "ppo1"])
    ap.add_argument("--blocks", type=int, default=8, help="blocks per arm")
    ap.add_argument("--block", type=int, default=5, help="iterations per block")
    ap.add_argument("--prefill", type=int, default=30_000, help="DQN: random timesteps put in the buffer first")
    ap.add_argument("--arms", default="none,ray_ckpt",
                    help="none, ray_ckpt, rllib_save (RLlib's own algo.save_to_path() after every train(), "
                         "synchronous), ray_ckpt_nice0 (the background processes at training's CPU priority), "
                         "ray_ckpt_mailbox (a local learner's states under 4 MiB copied on the copy thread and "
                         "announced through the run's mailbox, not in save())")
    ap.add_argument("--clone", action="store_true",
                    help="DQN: prefill with copies of up to 20k sampled timesteps' episodes (a 1M-row buffer in "
                         "~2.5 min, not ~24: rllib_iteration.prefill)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.config, args.prefill, args.clone)
        return
    arms = tuple(a for a in args.arms.split(",") if a)
    if arms[0] != "none" or not set(arms) <= {"none", "ray_ckpt", "rllib_save", "ray_ckpt_nice0", "ray_ckpt_mailbox"}:
        ap.error("--arms: 'none' first, then any of ray_ckpt, rllib_save, ray_ckpt_nice0, ray_ckpt_mailbox")
    procs, errs = {}, {}
    for arm in arms:  # built (and prefilled) at once: each is one busy thread, there are 2 cores
        procs[arm] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", arm, "--config",
                                       args.config, "--prefill", str(args.prefill)] + (["--clone"] if args.clone else []),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=errs.setdefault(arm, tempfile.TemporaryFile("w+")),  # read if it fails
                                      text=True, bufsize=1)
    for arm in arms:
        _read(procs[arm], "READY", errs[arm])
        print(f"  {arm}: built", flush=True)
    blocks = {arm: [] for arm in arms}
    try:
        for b in range(args.blocks):
            order = arms if b % 2 == 0 else arms[::-1]  # A B C | C B A | A B C ...
            for arm in order:
                procs[arm].stdin.write(f"run {args.block}\n")
                procs[arm].stdin.flush()
                blocks[arm].append(_read(procs[arm], "BLOCK ", errs[arm]))
            print(f"  block {b + 1}/{args.blocks}: " + ", ".join(
                f"{arm} {blocks[arm][-1]['block_s']:.2f}s" for arm in arms), flush=True)
        done = {}
        for arm in arms:
            procs[arm].stdin.write("stop\n")
            procs[arm].stdin.flush()
            done[arm] = _read(procs[arm], "DONE ", errs[arm])
    finally:
        for p in procs.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    n = args.blocks * args.block
    print()
    print(f"{args.config}: {args.blocks} blocks of {args.block} iterations per arm, alternating (A B B A ...)")
    print()
    print("| arm | train() s median | train() s mean | drain s per block (median) | block s (median) "
          "| CPU s per iteration (whole cluster) | rate vs none: total | rate vs none: median of block pairs "
          "| save() ms | bytes per save (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    total = {arm: sum(x["block_s"] for x in blocks[arm]) for arm in arms}
    for arm in arms:
        times = [t for x in blocks[arm] for t in x["times"]]
        rate = total["none"] / total[arm]
        paired = statistics.median(a["block_s"] / b["block_s"] for a, b in zip(blocks["none"], blocks[arm]))
        save = done[arm].get("save_ms")
        print(f"| {arm} | {statistics.median(times):.3f} | {statistics.mean(times):.3f} "
              f"| {statistics.median(x['drain'] for x in blocks[arm]):.3f} "
              f"| {statistics.median(x['block_s'] for x in blocks[arm]):.2f} "
              f"| {sum(x['cpu'] for x in blocks[arm]) / n:.3f} | {rate:.3f}x | {paired:.3f}x "
              f"| {'-' if save is None else f'{save:.1f}'} "
              f"| {'-' if done[arm].get('bytes') is None else format(int(done[arm]['bytes']), ',')} |")
    rows = [done[a]["rows"] for a in arms if done[a].get("rows")]
    if rows:
        print(f"\nreplay buffer rows at the end: {rows[0]:,}")
    print()
    print("CPU seconds per iteration by process (each arm's own cluster; IDLE: Ray's spare workers):")
    print()
    roles = {}
    for arm in arms:
        for x in blocks[arm]:
            for what, sec in x["by_role"].items():
                roles.setdefault(what, {a: 0.0 for a in arms})[arm] += sec / n
    print("| process | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for what, by in sorted(roles.items(), key=lambda kv: -max(kv[1].values())):
        if max(by.values()) >= 0.001:
            print(f"| {what} | " + " | ".join(f"{by[a]:.3f}" for a in arms) + " |")


if __name__ == "__main__":
    main()
