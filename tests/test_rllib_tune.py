"""The RLlib callback under Tune, with no engine created in the driver: each trial saves into its own
run (``<run>-<trial_id>``), a trial restarted by FailureConfig resumes only its own state, PBT clones
one trial's ray_ckpt version into another, and ``algorithm.stop()`` flushes the saves and stops the
coordinator the callback started (not a user's). Real Ray, Tune and RLlib on CPU."""
import os
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import ray  # noqa: E402
from ray import tune  # noqa: E402
from ray.rllib.callbacks.callbacks import RLlibCallback  # noqa: E402

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.protocol import NAMESPACE, actor_name  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# the callback classes below run inside the Tune trials' actors, which cannot import this module
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 256  # the example config's train_batch_size_per_learner


def _config(callbacks, seed=5, env_runners=1):
    example = runpy.run_path(str(ROOT / "examples" / "rllib_example.py"), run_name="rllib_example_config")
    config = example["build_config"](callbacks, seed=seed)
    return config if env_runners == 1 else config.env_runners(num_env_runners=env_runners)


def _callback(run_name, tmp_path, **kw):
    return rr.make_callback(run_name, local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                            every=1, **kw)


def _coordinator_alive(run: str) -> bool:
    try:
        ray.get_actor(actor_name(run), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def _policy(engine, version):
    return engine.load("policy", version=version)["default_policy"]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _fail_once_at(iteration: int, marker_dir: str) -> type:
    """Raises out of train() once per trial, at ``iteration`` (after that iteration's save is
    committed); the per-trial marker file survives the trial's restart."""

    class FailOnce(RLlibCallback):
        def on_train_result(self, *, algorithm, result, **kwargs):
            marker = os.path.join(marker_dir, f"failed-{rr.find_callback(algorithm).run}")  # one per trial
            if algorithm.iteration == iteration and not os.path.exists(marker):
                rr.wait_for_saves(algorithm, timeout=120)
                Path(marker).touch()
                raise RuntimeError(f"injected failure at iteration {iteration}")

    return FailOnce


class ScoreIsLr(RLlibCallback):
    """PBT's metric: the trial's learning rate (the trial with the larger one is cloned)."""

    def on_train_result(self, *, algorithm, result, **kwargs):
        result["score"] = float(algorithm.config.lr)


def _run_config(run_name, tmp_path, iterations, **kw):
    return tune.RunConfig(name=run_name, storage_path=str(tmp_path / "tune"), verbose=0,
                          stop={"training_iteration": iterations}, **kw)


# ---------------------------------------------------------------------------------------------------
def test_tune_settings_and_pointers_are_checked(tmp_path):
    for bad in ({"per_trial": "yes"}, {"tune_checkpoints": "full"}, {"stop_timeout_s": 0}):
        with pytest.raises(rc.InvalidArgumentError, match=next(iter(bad))):
            rr.make_callback("r1", local_dir=str(tmp_path), **bad)
    assert rr.tune.trial_run_name("ppo", "3f2a1_00001") == "ppo-3f2a1_00001"
    with pytest.raises(rc.InvalidArgumentError, match="per_trial=False"):
        rr.tune.trial_run_name("x" * 125, "3f2a1_00001")
    assert rr.tune.read_pointer(str(tmp_path)) is None  # no pointer file: an RLlib checkpoint, loaded by RLlib
    rr.tune.write_pointer(str(tmp_path), "ppo-3f2a1_00001", 7, 5)
    assert rr.tune.read_pointer(str(tmp_path)) == {"format": rr.tune.POINTER_FORMAT, "run": "ppo-3f2a1_00001",
                                                   "version": 7, "iteration": 5}
    (tmp_path / rr.tune.POINTER_FILE).write_text('{"format": "%s", "run": "../x", "version": 1, "iteration": 1}'
                                                 % rr.tune.POINTER_FORMAT)
    with pytest.raises(rc.RestoreError, match="not a ray_ckpt version pointer"):
        rr.tune.read_pointer(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_grid_search_with_restarts_keeps_each_trials_state_apart(ray_session, engine_factory, run_name,
                                                                   tmp_path):
    # no engine in the driver: each trial's callback creates its run's coordinator and writers, which
    # must be placed outside the trial's placement group (they do not fit its bundles)
    assert not _coordinator_alive(run_name)
    markers = tmp_path / "markers"
    markers.mkdir()
    config = _config([_callback(run_name, tmp_path, resume=True), _fail_once_at(1, str(markers))], env_runners=0)
    config.training(lr=tune.grid_search([0.0, 1e-3]))
    results = tune.Tuner(config.algo_class, param_space=config, run_config=_run_config(
        run_name, tmp_path, 2, failure_config=tune.FailureConfig(max_failures=1))).fit()

    assert len(list(markers.iterdir())) == 2, "not every trial failed once: the restarts were not tested"
    assert len(results) == 2
    runs = {}
    for result in results:
        assert result.error is None, result.error
        m = result.metrics
        summary = m["ray_ckpt"]
        # each restarted trial resumed from its own version 1 and ran iteration 2 only ...
        assert summary["resumed_version"] == 1 and summary["saves"] == 1 and summary["failed"] == 0, summary
        assert m["training_iteration"] == 2
        # ... with its sampled-steps counter brought back (not the other trial's, not reset)
        assert 2 * BATCH <= m["env_runners"]["num_env_steps_sampled_lifetime"] < 3 * BATCH, m["env_runners"]
        assert summary["run"] == f"{run_name}-{m['trial_id']}", summary
        runs[result.config["lr"]] = summary["run"]
    assert len(set(runs.values())) == 2
    for lr, run in runs.items():
        # algorithm.stop() at the trial's end flushed the saves and stopped the coordinator it started
        assert not _coordinator_alive(run)
        engine = engine_factory(run=run)
        assert [meta.version for meta in engine.list_checkpoints()] == [1, 2], (lr, engine.status())
        first, last = _policy(engine, 1), _policy(engine, 2)
        if lr == 0.0:
            assert _same(first, last), "the lr=0 trial's weights changed: it resumed another trial's state"
        else:
            assert not _same(first, last)


def _set_lr(learner, lr):
    """Every optimizer's lr, set by hand (the reference run of the PBT test)."""
    for module_id in learner.module.keys():
        for _name, optimizer in learner.get_optimizers_for_module(module_id):
            for group in optimizer.param_groups:
                group["lr"] = lr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pbt_clones_a_trials_ray_ckpt_version_into_another(ray_session, engine_factory, run_name, tmp_path):
    from ray.tune.schedulers import PopulationBasedTraining

    # trial B (lr=1e-3) scores higher than trial A (lr=1e-4); at iteration 1 PBT (synchronous: both
    # trials pause) clones B into A and mutates A's lr to 5e-4 (not B's): A's iteration 2 must be what
    # B's version 1 gives in one iteration with lr 5e-4, bit for bit, if A got all of B's state
    # (weights, optimizer moments, connectors, counters, RNGs) from ray_ckpt and trained with its own lr
    # from its first iteration (the restored optimizer param_groups hold B's lr)
    pbt = PopulationBasedTraining(time_attr="training_iteration", metric="score", mode="max",
                                  perturbation_interval=1, synch=True, quantile_fraction=0.5,
                                  hyperparam_mutations={"lr": [5e-4]})
    config = _config([_callback(run_name, tmp_path), ScoreIsLr], env_runners=0)
    config.training(lr=tune.grid_search([1e-4, 1e-3]))
    results = tune.Tuner(config.algo_class, param_space=config, tune_config=tune.TuneConfig(scheduler=pbt),
                         run_config=_run_config(run_name, tmp_path, 2)).fit()

    assert len(results) == 2 and all(r.error is None for r in results), [r.error for r in results]
    summaries = [r.metrics["ray_ckpt"] for r in results]
    run_b = summaries[0]["restored_from"].rsplit("@", 1)[0]
    assert all(s["restored_from"] == f"{run_b}@1" for s in summaries), summaries  # A: B's version; B: its own
    (a,) = [s for s in summaries if s["run"] != run_b]
    run_a = a["run"]
    assert run_a.startswith(f"{run_name}-") and run_b.startswith(f"{run_name}-")
    assert all(r.metrics["training_iteration"] == 2 for r in results)
    assert sorted(r.config["lr"] for r in results) == [5e-4, 1e-3]

    eng_a, eng_b = engine_factory(run=run_a), engine_factory(run=run_b)
    assert [m.version for m in eng_a.list_checkpoints()] == [1, 2]  # A's own run, after the clone too
    assert [m.version for m in eng_b.list_checkpoints()] == [1, 2]  # nothing of A's went into B's run
    assert not _same(_policy(eng_a, 1), _policy(eng_b, 1))  # the trials differed before the exploit
    assert not _same(_policy(eng_a, 2), _policy(eng_b, 2)), "A's first iteration after the clone used B's lr"
    assert eng_a.load("counters", version=2)["training_iteration"] == 2

    # the reference: B's version 1 restored here into an algorithm built with lr=5e-4, every
    # optimizer's lr set to 5e-4 by hand, one iteration
    ref = _config([ScoreIsLr], env_runners=0).training(lr=5e-4).build_algo()
    try:
        rr.restore_algorithm(ref, eng_b, 1)
        ref.learner_group.foreach_learner(_set_lr, lr=5e-4)
        ref.train()
        want = ref.learner_group.get_state(components="learner/rl_module")["learner"]["rl_module"]["default_policy"]
    finally:
        ref.stop()
    assert _same(_policy(eng_a, 2), want), "A's iteration 2 is not B's version 1 trained with A's own lr"
    # Tune's own checkpoints held only the pointer (a few bytes), not the algorithm's state
    for r in results:
        files = {f.name: f.stat().st_size for f in Path(r.checkpoint.path).iterdir() if f.is_file()}
        assert rr.tune.POINTER_FILE in files and sum(files.values()) < 4096, files


@pytest.mark.timeout(300)
def test_algorithm_stop_flushes_and_leaves_a_coordinator_the_user_started(ray_session, engine_factory, run_name,
                                                                         tmp_path):
    # (a run the callback created itself is stopped by algorithm.stop(): the grid search test asserts it)
    engine = engine_factory()  # the user created the run: stop() flushes but leaves the coordinator running
    algo = _config(_callback(run_name, tmp_path)).env_runners(num_env_runners=0).build_algo()
    try:
        algo.train()
        assert rr.find_callback(algo).summary()["saves"] == 1
    finally:
        algo.stop()
    assert _coordinator_alive(run_name)
    # version 1 was committed before stop() returned (no wait here)
    assert [m.version for m in engine.list_checkpoints()] == [1]
    assert engine.load("counters", version=1)["training_iteration"] == 1
