"""make_callback(..., resume=True): a Tune trial that fails mid-run and is restarted by
FailureConfig(max_failures=1) -- with no Tune checkpoint -- resumes from ray_ckpt's latest version in
on_algorithm_init, with no user code, and finishes with the restored counters."""
import os
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

from ray.rllib.callbacks.callbacks import RLlibCallback  # noqa: E402

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# the callback class below runs inside the Tune trial's actor, which cannot import this test module
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BATCH = 256  # the example config's train_batch_size_per_learner: env steps sampled per iteration (at least)


def _fail_once_at(iteration: int, marker: str) -> type:
    """A callback that raises out of train() once, at ``iteration`` (after that iteration's save is
    committed), and never again (the marker file survives the trial's restart)."""

    class FailOnce(RLlibCallback):
        def on_train_result(self, *, algorithm, result, **kwargs):
            if algorithm.iteration == iteration and not os.path.exists(marker):
                rr.wait_for_saves(algorithm, timeout=120)
                Path(marker).touch()
                raise RuntimeError(f"injected failure at iteration {iteration}")

    return FailOnce


def test_resume_setting_is_validated(tmp_path):
    with pytest.raises(rc.InvalidArgumentError, match="resume"):
        rr.make_callback("r1", local_dir=str(tmp_path), resume="yes")
    assert rr.make_callback("r1", local_dir=str(tmp_path), resume=True).settings.resume is True


@pytest.mark.timeout(480)
def test_tune_trial_restarted_after_a_failure_resumes_from_ray_ckpt(engine_factory, run_name, tmp_path):
    from ray import tune

    # no engine in the driver: the trial's callback creates the trial's own run, <run_name>-<trial_id>
    cb = rr.make_callback(run_name, local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                          every=1, resume=True)
    marker = tmp_path / "failed_once"
    example = runpy.run_path(str(ROOT / "examples" / "rllib_example.py"), run_name="rllib_example_config")
    config = example["build_config"]([cb, _fail_once_at(1, str(marker))], seed=11)

    tuner = tune.Tuner(config.algo_class, param_space=config, run_config=tune.RunConfig(
        name=run_name, storage_path=str(tmp_path / "tune"), stop={"training_iteration": 2}, verbose=0,
        failure_config=tune.FailureConfig(max_failures=1)))
    results = tuner.fit()

    assert marker.exists(), "the trial never failed: the test did not test the restart"
    result = results[0]
    assert result.error is None, result.error
    m = result.metrics
    summary = m["ray_ckpt"]
    # the restarted trial resumed from version 1 and ran only iteration 2 ...
    assert summary["resumed_version"] == 1, summary
    assert m["training_iteration"] == 2
    assert summary["saves"] == 1 and summary["last_saved_iteration"] == 2 and summary["failed"] == 0, summary
    # ... yet its sampled-steps counter covers both iterations: it came back with the restore
    assert m["env_runners"]["num_env_steps_sampled_lifetime"] >= 2 * BATCH, m["env_runners"]
    # the trial's algorithm.stop() waited for the last save and stopped the coordinator it started
    assert summary["run"] == f"{run_name}-{m['trial_id']}"
    engine = engine_factory(run=summary["run"])  # the run again, from storage (the fixture shuts it down)
    assert [meta.version for meta in engine.list_checkpoints()] == [1, 2], engine.status()
