"""RLlib: what a resume costs, ray_ckpt's (replay buffer included) beside RLlib's own, in one run.

    python benchmarks/rllib_resume.py [--iterations 4] [--repeats 5] [--config dqn|madqn] [--dir /tmp/rllib_resume]

Why: a preempted learner's resume is time the job does not train (goodput.py's RLlib arms resume
three times a phase). One Algorithm (``rllib_iteration.py``'s DQN: CartPole, a prioritized buffer
of capacity 1M, or ``madqn``: the multi-agent one) trains ``--iterations`` iterations with ray_ckpt's
callback saving every one (local tier, one critical writer), then RLlib's own ``save_to_path``.
A second Algorithm built from the same config is restored ``--repeats`` times, alternating:
``ray_ckpt``: ``restore_algorithm(algo, engine)`` of the newest version (every state read and
verified, the replay buffer rebuilt from its journal, env runners checked) into a buffer as
``build_algo()`` makes it (what a resume restores into; made anew before each repeat, untimed);
``ray_ckpt_used``: the same restore again, into that buffer now in use; ``rllib``:
``algo.restore_from_path(path)`` (RLlib's checkpoint holds no replay buffer). Printed: median and
min seconds per arm, their ratio, the buffer's stored timesteps and the replay part of ray_ckpt's
resume. What limits it: a 1M-capacity buffer holding a few thousand rows (the first minutes of a
run, where goodput.py's learners are): its trees are O(capacity) lists in RLlib; a full buffer is
``replay_journal.py``'s measure.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--config", choices=("dqn", "madqn"), default="dqn")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)

    import ray
    import torch

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    import rllib_iteration as bench

    import ray_ckpt as rc
    from ray_ckpt.integrations import rllib as rr
    from ray_ckpt.integrations.rllib.restore import restore_algorithm
    from ray_ckpt.integrations.rllib.replay import algorithm as replay_algorithm

    config = bench.dqn_config if args.config == "dqn" else bench.ma_dqn_config
    root = args.dir or tempfile.mkdtemp(prefix="rc_rllib_resume_")
    try:
        engine = rc.CheckpointEngine.create("resume", local_dir=os.path.join(root, "local"), critical_writers=1,
                                            best_effort_writers=0)
        algo = config(0).callbacks(rr.make_callback("resume", every=1, on_busy="queue")).build_algo()
        for _ in range(args.iterations):
            algo.train()
        engine.wait_until_finished(timeout=300)
        path = os.path.join(root, "rllib")
        algo.save_to_path(path)
        rows = algo.local_replay_buffer.get_num_timesteps()
        algo.stop()

        fresh = config(0).build_algo()
        from ray.rllib.utils.from_config import from_config
        from ray.rllib.utils.replay_buffers import ReplayBuffer
        buffer_config = dict(fresh.config.replay_buffer_config,
                             metrics_num_episodes_for_smoothing=fresh.config.metrics_num_episodes_for_smoothing)
        times = {"ray_ckpt": [], "ray_ckpt_used": [], "rllib": []}
        replay_s = {"ray_ckpt": [], "ray_ckpt_used": []}
        arm = ["ray_ckpt"]
        real = replay_algorithm.restore_algorithm_replay

        def timed_replay(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                replay_s[arm[0]].append(time.perf_counter() - t)

        import ray_ckpt.integrations.rllib.restore as restore_module
        restore_module.restore_algorithm_replay = timed_replay
        for _ in range(args.repeats):
            # a resume: the buffer as build_algo() makes it (made outside the timing, as RLlib's own
            # restore_from_path gets the algorithm built); then the same restore into that buffer,
            # now in use (a rollback or PBT exploit in a running algorithm)
            fresh.local_replay_buffer = from_config(ReplayBuffer, dict(buffer_config))
            for arm[0] in ("ray_ckpt", "ray_ckpt_used"):
                t = time.perf_counter()
                restore_algorithm(fresh, engine)
                times[arm[0]].append(time.perf_counter() - t)
            t = time.perf_counter()
            fresh.restore_from_path(path)
            times["rllib"].append(time.perf_counter() - t)
        restore_module.restore_algorithm_replay = real
        fresh.stop()

        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{args.config}: buffer capacity 1M holding {rows:,} timesteps after {args.iterations} iterations; "
              f"{args.repeats} restores per arm, alternating\n")
        print("| arm | restore s median | min | of which the replay buffer | what it restores |")
        print("|---|---|---|---|---|")
        for name, what in (("ray_ckpt", "into the buffer build_algo() made (a resume)"),
                           ("ray_ckpt_used", "again, into that buffer now in use")):
            print(f"| ray_ckpt `restore_algorithm` {what} | {med[name]:.3f} | {min(times[name]):.3f} | "
                  f"{statistics.median(replay_s[name]):.3f} | learner, optimizer, connectors, counters, "
                  f"metrics, RNGs, replay buffer, every file verified |")
        print(f"| RLlib `restore_from_path` | {med['rllib']:.3f} | {min(times['rllib']):.3f} | — | RLlib's "
              f"checkpoint (no replay buffer) |")
        print(f"| **ray_ckpt (resume) / RLlib** | **{med['ray_ckpt'] / med['rllib']:.2f}x** | | | |")
        engine.shutdown(stop_coordinator=True)
    finally:
        ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
