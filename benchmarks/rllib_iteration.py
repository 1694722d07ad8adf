"""RLlib: what checkpointing every iteration costs train(), side by side in one run.

    python benchmarks/rllib_iteration.py [--iterations 8] [--prefill 30000] [--configs ppo0,ppo1,dqn[,madqn]] [--dir /tmp/rllib_bench]

Per algorithm config, one Algorithm per arm, built from the same config and seed, all built first
and then trained ``--iterations`` iterations *interleaved* (iteration i of every arm, the arms'
order shuffled (seeded) each iteration, so a slow minute of the shared machine falls on every arm alike; the
first two iterations are warm-up and not counted). After a ray_ckpt arm's iteration the benchmark
waits, untimed, until that iteration's version is committed (``--overlap`` leaves this out), so its
writers' background work does not fall on the next arm's timed iteration; the time from the start
of train() to the version committed is reported beside it ("durable s"). So this measures what
train() itself waits for (the callback's save()) and the bytes; the rate with the writers' work
overlapping training is ``rllib_rate.py``'s (arms in processes of their own, taking turns):

  none         no checkpointing
  ray_ckpt     ray_ckpt's callback saves every iteration (make_callback(..., every=1)); train()
               includes the callback's capture and save() call, not the writers' work (they run
               beside it, on the same 2 cores)
  ray_ckpt_full  DQN only (both): the same with the replay journal told to write the whole buffer
               at every save (its ``full_because`` set before each capture: what the first save
               after a restore from elsewhere writes) -- what the journal's incremental saves save
  rllib_save   RLlib's own ``algo.save_to_path()`` after every train() (synchronous)
  paired       ray_ckpt's callback saving at a seeded random half of the iterations of one
               Algorithm: its iterations with a save against its iterations without, the same
               actors and buffer, so that the difference between Algorithms (noise of +-10 % on 2
               shared cores) drops out; its "rate vs none" is its no-save iterations' median over
               its save iterations' median. Random, not every second iteration, which can line up
               with an algorithm's periodic work (DQN's target updates)

Configs: PPO on CartPole with num_learners=0 and =1 (``ppo0``, ``ppo1``); DQN on CartPole with a
prioritized replay buffer of capacity 1M (``dqn``), and multi-agent DQN on MultiAgentCartPole (two
agents, one policy each) with a multi-agent prioritized buffer of capacity 1M (``madqn``, not run by
default), each prefilled with ``--prefill`` timesteps of the untrained (epsilon-greedy) policy so that a save's buffer
is large next to what one iteration adds.

Printed: median and mean train() seconds per arm and the iteration rate relative to ``none`` by
each (the mean is the rate over the whole run: it carries the rare full garbage collections of
the process, ~0.4 s each, which the median leaves out, on whichever arm set them off), and for ray_ckpt
the callback's save() and, for DQN, the replay buffer's capture inside it (ms), the median bytes
per save and the bytes the replay state (``replay_journal``, format /6) wrote per version against
its new rows' segment (the records of what the iteration added), with each replay file's median size.
``--bytes-only`` runs without the ``none`` arm: bytes only, which do not depend on the load.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def ppo_config(num_learners: int, seed: int = 1):
    from ray.rllib.algorithms.ppo import PPOConfig

    cfg = (PPOConfig().environment("CartPole-v1")
           .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.25)
           .training(train_batch_size_per_learner=512, minibatch_size=128, num_epochs=2)
           .debugging(seed=seed))
    if num_learners:
        cfg = cfg.learners(num_learners=num_learners, num_cpus_per_learner=0.5)
    return cfg


def dqn_config(seed: int = 1):
    from ray.rllib.algorithms.dqn import DQNConfig

    return (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=100)
            .training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 1_000_000},
                      num_steps_sampled_before_learning_starts=1000, train_batch_size_per_learner=32)
            .reporting(min_sample_timesteps_per_iteration=500)
            .debugging(seed=seed))


def _policy_of(agent_id, episode, **kw):
    return f"p{agent_id}"


def ma_dqn_config(seed: int = 1):
    """Multi-agent DQN: MultiAgentCartPole with two agents, one policy each, a multi-agent
    prioritized buffer of capacity 1M (rows are agent timesteps: ~2 per env step)."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

    return (DQNConfig().environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=_policy_of)
            .env_runners(num_env_runners=0, rollout_fragment_length=100)
            .training(replay_buffer_config={"type": "MultiAgentPrioritizedEpisodeReplayBuffer",
                                            "capacity": 1_000_000, "alpha": 0.6, "beta": 0.4},
                      num_steps_sampled_before_learning_starts=1000, train_batch_size_per_learner=32)
            .reporting(min_sample_timesteps_per_iteration=500)
            .debugging(seed=seed))


def prefill(algo, timesteps: int, clone: bool = False) -> None:
    """Episodes of the untrained policy (epsilon-greedy: epsilon starts at 1) from the algorithm's own env runner straight into its replay buffer
    (no training), so that a save's buffer is large next to what one iteration adds.

    ``clone``: at most 20,000 timesteps sampled so, then copies of their done episodes (new ids) until
    the buffer holds ``timesteps`` rows, never past its capacity (RLlib's ``add`` is quadratic in the
    episodes one call evicts). Why: sampling runs at ~700 steps/s here, 24 minutes for a 1M-row
    buffer; cloned, it takes ~2.5. The buffer's structure (episode lengths, rows, trees) is that of
    sampled episodes; its values repeat, which no measured cost depends on (a save converts and
    writes the rows training adds, which are sampled)."""
    if not clone:
        left = timesteps
        while left > 0:
            n = min(left, 20_000)
            episodes = algo.env_runner.sample(num_timesteps=n, explore=True)
            algo.local_replay_buffer.add(episodes)
            left -= sum(len(e) for e in episodes)
        return
    import uuid

    from ray.rllib.env.single_agent_episode import SingleAgentEpisode

    buf = algo.local_replay_buffer
    states = [e.get_state() for e in algo.env_runner.sample(num_timesteps=min(timesteps, 20_000), explore=True)
              if e.is_done]
    while len(buf) < timesteps:
        batch, room = [], min(timesteps, buf.capacity) - len(buf)
        for st in states:
            ep = SingleAgentEpisode.from_state({**st, "id_": uuid.uuid4().hex})
            if len(ep) > room:
                break
            room -= len(ep)
            batch.append(ep)
        if not batch:
            return
        buf.add(batch)


def build_arm(make_config, arm: str, root: str, prefill_steps: int):
    """One arm's Algorithm (with the callback for the ray_ckpt arms), its buffer prefilled."""
    from ray_ckpt.integrations import rllib as rr

    cfg = make_config()
    run = f"bench-{arm}-{uuid.uuid4().hex[:6]}"
    if arm.startswith("ray_ckpt") or arm == "paired":
        cfg = cfg.callbacks(rr.make_callback(run, local_dir=os.path.join(root, "local"), every=1,
                                             on_busy="queue", engine_options={"critical_writers": 1,
                                                                              "best_effort_writers": 1}))
    algo = cfg.build_algo()
    prefill(algo, prefill_steps)
    return run, algo


def run_arms(make_config, arms, iterations: int, root: str, prefill_steps: int, overlap: bool = False) -> dict:
    """All arms built first, then their iterations interleaved (arm order shuffled every iteration),
    so that a slow minute of the shared machine falls on every arm alike."""
    from ray_ckpt.integrations import rllib as rr
    from ray_ckpt.integrations.rllib import capture as rr_capture
    from ray_ckpt.integrations.rllib.replay.journal import journal_of

    built = {}
    capture_ms = {arm: [] for arm in arms}
    current = [None]
    original = rr_capture.capture_algorithm_replay

    def timed(algorithm, *a, **kw):  # the replay buffer's capture inside train() (the callback's save)
        if current[0] == "ray_ckpt_full":  # this save writes the whole buffer (a full capture, new row ids)
            journal_of(algorithm.local_replay_buffer).full_because = "benchmark: the whole buffer every save"
        t0 = time.perf_counter()
        try:
            return original(algorithm, *a, **kw)
        finally:
            capture_ms[current[0]].append((time.perf_counter() - t0) * 1e3)

    rr_capture.capture_algorithm_replay = timed
    try:
        for arm in arms:
            built[arm] = build_arm(make_config, arm, root, prefill_steps)
        times = {arm: [] for arm in arms}
        durable = {arm: [] for arm in arms}
        saved = {arm: [] for arm in arms}  # paired: whether that iteration saved
        pick = random.Random(12345)  # paired: which iterations save
        for i in range(iterations):
            order = list(arms)
            random.Random(i).shuffle(order)  # not a rotation: each arm follows each other arm alike
            for arm in order:
                run, algo = built[arm]
                current[0] = arm
                cb = rr.find_callback(algo) if arm == "paired" else None
                calls = len(cb.save_call_ms) if cb else 0
                if cb is not None:  # this iteration saves or not: a seeded coin (the callback's own setting)
                    cb.settings.every = 1 if pick.random() < 0.5 else 1 << 30
                t0 = time.perf_counter()
                algo.train()
                if cb:
                    saved[arm].append(len(cb.save_call_ms) > calls)
                if arm == "rllib_save":
                    algo.save_to_path(os.path.join(root, "rllib", run, f"it{i}"))
                times[arm].append(time.perf_counter() - t0)
                if (arm.startswith("ray_ckpt") or arm == "paired") and not overlap:  # untimed: its writers finish
                    rr.wait_for_saves(algo, timeout=600)
                    if cb is None or saved[arm][-1]:
                        durable[arm].append(time.perf_counter() - t0)
        out = {}
        for arm in arms:
            run, algo = built[arm]
            r = {"train_s": statistics.median(times[arm][2:]), "mean_s": statistics.mean(times[arm][2:]),
                 "bytes": None, "new_rows": None, "save_ms": None,
                 "replay": None, "capture_ms": statistics.median(capture_ms[arm][2:]) if capture_ms[arm][2:] else None,
                 "durable_s": statistics.median(durable[arm][2:]) if durable[arm][2:] else None}
            if arm == "paired":
                pairs = list(zip(times[arm], saved[arm]))[2:]
                with_save = statistics.median(t for t, s in pairs if s)
                without = statistics.median(t for t, s in pairs if not s)
                r.update(train_s=with_save, paired=(without, with_save),
                         mean_s=statistics.mean(t for t, s in pairs if s),
                         paired_mean=statistics.mean(t for t, s in pairs if not s),
                         save_ms=statistics.median(rr.find_callback(algo).save_call_ms[1:]))
            elif arm.startswith("ray_ckpt"):
                r["save_ms"] = statistics.median(rr.find_callback(algo).save_call_ms[2:])
                results = rr.wait_for_saves(algo, timeout=600)
                sizes = [x.bytes_written for it, x in sorted(results.items()) if it > 2]
                r["bytes"] = statistics.median(sizes) if sizes else None
                r["new_rows"] = _new_segment_bytes(os.path.join(root, "local", run))
                r["replay"] = _replay_bytes(os.path.join(root, "local", run))
                r["per_file"] = _replay_files(os.path.join(root, "local", run))
            elif arm == "rllib_save":
                r["bytes"] = _dir_bytes(os.path.join(root, "rllib", run, f"it{iterations - 1}"))
            out[arm] = r
        return out
    finally:
        rr_capture.capture_algorithm_replay = original
        for run, algo in built.values():
            algo.stop()


def _new_segment_bytes(run_dir: str):
    """Median size of the replay journal's segments written by the versions after the warm-up (the
    records of what each iteration added), or None when the run has no replay journal."""
    sizes = []
    for v in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        p = os.path.join(run_dir, v, REPLAY_STATES[0], "rank0.segment.arrow")
        if v.startswith("v") and int(v[1:]) > 2 and os.path.exists(p):
            sizes.append(os.path.getsize(p))
    return statistics.median(sizes) if sizes else None


REPLAY_STATES = ("replay_journal",)  # format /6: the journal is the buffer's only state


def _replay_bytes(run_dir: str):
    """Median bytes a version after the warm-up wrote for the replay buffer: its own files of the
    replay states (segments it reuses lie in older versions' directories)."""
    sizes = []
    for v in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if v.startswith("v") and int(v[1:]) > 2 and os.path.isdir(os.path.join(run_dir, v, REPLAY_STATES[0])):
            sizes.append(sum(_dir_bytes(os.path.join(run_dir, v, s)) for s in REPLAY_STATES))
    return statistics.median(sizes) if sizes else None


def _replay_files(run_dir: str) -> dict:
    """Median bytes per replay file a version after the warm-up wrote (``state/file``), so that
    the data and the framing of each can be told apart."""
    sizes: dict = {}
    for v in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if not (v.startswith("v") and int(v[1:]) > 2):
            continue
        for s in REPLAY_STATES:
            d = os.path.join(run_dir, v, s)
            for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
                sizes.setdefault(f"{s}/{f}", []).append(os.path.getsize(os.path.join(d, f)))
    return {k: statistics.median(v) for k, v in sizes.items()}


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=30_000, help="DQN: random (env) timesteps put in the buffer first")
    ap.add_argument("--configs", default="ppo0,ppo1,dqn")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--arms", default=None, help="only these arms (comma-separated; 'none' is run unless --bytes-only)")
    ap.add_argument("--bytes-only", action="store_true",
                    help="without the 'none' arm: the bytes per save only (they do not depend on the machine's load)")
    ap.add_argument("--overlap", action="store_true",
                    help="do not wait for a ray_ckpt arm's version after its iteration (its writers then run "
                         "during the next arm's timed iteration)")
    args = ap.parse_args()

    import ray

    # a Ray of its own (address="local"): other sessions' clusters on this machine are not joined
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    root = args.dir or tempfile.mkdtemp(prefix="rllib_bench_")
    configs = {"ppo0": (lambda: ppo_config(0), ["none", "ray_ckpt", "rllib_save", "paired"], 0),
               "ppo1": (lambda: ppo_config(1), ["none", "ray_ckpt", "rllib_save", "paired"], 0),
               "dqn": (dqn_config, ["none", "ray_ckpt", "ray_ckpt_full", "rllib_save", "paired"], args.prefill),
               "madqn": (ma_dqn_config, ["none", "ray_ckpt", "ray_ckpt_full", "rllib_save", "paired"], args.prefill)}
    rows, files = [], []
    try:
        for name in args.configs.split(","):
            make, arms, pre = configs[name]
            if args.arms:
                arms = [a for a in arms if a == "none" or a in args.arms.split(",")]
            if args.bytes_only:
                arms = [a for a in arms if a != "none"]
            res = run_arms(make, arms, args.iterations, root, pre, args.overlap)
            base = res["none"]["train_s"] if "none" in res else float("nan")
            for arm, r in res.items():
                if "paired" in r:  # its own no-save iterations are its base
                    without, with_save = r["paired"]
                    print(f"  {name:5s} paired: no-save iterations {without:.3f}s, save iterations {with_save:.3f}s",
                          flush=True)
                base_mean = r["paired_mean"] if "paired" in r else \
                    (res["none"]["mean_s"] if "none" in res else float("nan"))
                rows.append((name, arm, r["train_s"], (r["paired"][0] if "paired" in r else base) / r["train_s"],
                             r["mean_s"], base_mean / r["mean_s"], r["bytes"], r["new_rows"], r["save_ms"],
                             r["replay"], r["capture_ms"], r["durable_s"]))
                files.append((name, arm, r.get("per_file")))
                print(f"  {name:5s} {arm:14s} train() {r['train_s']:.3f}s", flush=True)
    finally:
        if not args.dir:  # a --dir given is kept: its versions can be inspected
            shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()

    print()
    print("| config | arm | train() s (median) | iteration rate vs none (medians) | train() s (mean) "
          "| iteration rate vs none (means) | callback save ms | replay capture ms "
          "| durable s | bytes per save | replay bytes per save | new rows' segment | replay bytes / new rows |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, arm, t, ratio, mean, mratio, nbytes, new, ms, rep, cap, dur in rows:
        b = f"{nbytes:,.0f}" if nbytes else "-"
        n = f"{new:,.0f}" if new else "-"
        q = f"{rep / new:.2f}x" if rep and new else "-"
        m = f"{ms:.1f}" if ms is not None else "-"
        c = f"{cap:.1f}" if cap is not None else "-"
        rb = f"{rep:,.0f}" if rep else "-"
        d = f"{dur:.3f}" if dur is not None else "-"
        print(f"| {name} | {arm} | {t:.3f} | {ratio:.3f}x | {mean:.3f} | {mratio:.3f}x | {m} | {c} | {d} | {b} | {rb} | {n} | {q} |")
    for name, arm, per_file in files:
        if per_file:
            print(f"\n{name} {arm}: median bytes per replay file a version writes: " +
                  ", ".join(f"{k} {v:,.0f}" for k, v in per_file.items()))


if __name__ == "__main__":
    main()
