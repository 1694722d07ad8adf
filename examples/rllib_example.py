"""RLlib PPO on CartPole saved by ray_ckpt's callback, restored into a fresh Algorithm, trained on.

    pip install "ray-ckpt[rllib]"
    python examples/rllib_example.py [--iterations 4] [--every 1] [--dir /tmp/ckpt]

The run trains PPO (new API stack, one remote env runner, a MeanStdFilter observation normaliser)
for ``--iterations`` iterations; ``make_callback`` saves every ``--every`` iterations from inside
``train()`` without waiting for storage. The algorithm is then stopped (the "preemption"), a fresh
one is built from the same config, ``restore_algorithm`` brings it back from the latest version and
synchronises + verifies the remote env runner's weights, and it trains one more iteration.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np



def build_config(callback, seed: int = 1):
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module import MeanStdFilter

    return (
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.25, num_envs_per_env_runner=1,
                     env_to_module_connector=lambda env, spaces=None, device=None: MeanStdFilter())
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=1)
        .callbacks(callback)
        .debugging(seed=seed)
    )


def _learner_weights(algo, inference_only=False):
    return algo.learner_group.get_state(components="learner/rl_module", inference_only=inference_only)[
        "learner"]["rl_module"]


def _return(result) -> float:
    return float(result["env_runners"].get("episode_return_mean", float("nan")))


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[m].keys() == b[m].keys() and all(np.array_equal(a[m][k], b[m][k]) for k in a[m]) for m in a)


def run(root: str, iterations: int, every: int, quiet: bool = False) -> dict:
    from ray_ckpt.integrations.rllib import (env_runner_weights, find_callback, make_callback,
                                             restore_algorithm, wait_for_saves)

    say = (lambda *a: None) if quiet else print
    run_name = f"rllib-example-{uuid.uuid4().hex[:8]}"
    cb = make_callback(run_name, local_dir=os.path.join(root, "local"), remote_uri=f"file://{root}/remote",
                       every=every, keep_last=3,
                       engine_options={"critical_writers": 1})  # small states: one writer is plenty
    algo = build_config(cb).build_algo()
    try:
        for _ in range(iterations):
            r = algo.train()
            say(f"  iteration {algo.iteration:2d}  episode return {_return(r):6.1f}"
                f"  save() call {r['ray_ckpt']['last_save_call_ms']:6.2f} ms")
        callback = find_callback(algo)
        results = wait_for_saves(algo, timeout=120)
        saved = _learner_weights(algo)
        engine = callback.engine
    finally:
        algo.stop()  # the "preemption": learner and env runner are gone
    say("  algorithm stopped; building a fresh one and restoring it")

    fresh = build_config(cb).build_algo()
    try:
        t0 = time.perf_counter()
        report = restore_algorithm(fresh, run_name, timeout_s=60)
        restore_s = time.perf_counter() - t0
        restored = _learner_weights(fresh)
        inference = _learner_weights(fresh, inference_only=True)
        remote = env_runner_weights(fresh)  # fetched right after the restore, before any train()
        learner_equal = _equal(saved, restored)
        remote_equal = bool(remote) and all(_equal(w, inference) for w in remote.values())
        say(f"  restored version {report.version} (iteration {report.iteration}) in {restore_s:.3f}s "
            f"(env runner sync + verify {report.sync_seconds * 1e3:.1f} ms): "
            + ", ".join(f"{k}={v}" for k, v in sorted(report.states.items())))
        r = fresh.train()
        say(f"  iteration {fresh.iteration:2d}  episode return {_return(r):6.1f}  (continued after the restore)")
        wait_for_saves(fresh, timeout=120)
        continued = fresh.iteration == report.iteration + 1
    finally:
        fresh.stop()
    engine.shutdown()
    return {"iterations": iterations, "saves": len(results), "save_ms": list(callback.save_call_ms),
            "bytes": sum(x.bytes_written for x in results.values()), "restore_s": restore_s,
            "learner_equal": learner_equal, "remote_equal": remote_equal, "env_runners": report.env_runners,
            "continued": continued}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory)")
    args = ap.parse_args(argv)
    try:
        import ray.rllib  # noqa: F401
    except ImportError as exc:
        print(f'this example needs RLlib: pip install "ray-ckpt[rllib]" ({exc})', file=sys.stderr)
        return 2
    root = args.dir or tempfile.mkdtemp(prefix="ray_ckpt_rllib_")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        print(f"PPO CartPole-v1: {args.iterations} iterations, save every {args.every}")
        st = run(root, args.iterations, args.every)
    finally:
        if started:
            ray.shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    same = st["learner_equal"] and st["remote_equal"]
    rows = [("iterations", f"{st['iterations']} + 1"), ("saves", str(st["saves"])),
            ("median save() call", f"{statistics.median(st['save_ms']):.2f} ms"),
            ("bytes written", f"{st['bytes']:,}"),
            ("restore time", f"{st['restore_s']:.3f} s"),
            ("weights equal", "yes" if same else "no"),
            ("training continued", "yes" if st["continued"] else "no")]
    print()
    w = max(len(k) for k, _ in rows)
    print("+-" + "-" * w + "-+-" + "-" * 16 + "-+")
    for k, v in rows:
        print(f"| {k:<{w}} | {v:>16} |")
    print("+-" + "-" * w + "-+-" + "-" * 16 + "-+")
    return 0 if same and st["continued"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
