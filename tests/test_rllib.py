"""RLlib integration: a PPO run saved by the callback, restored into a fresh Algorithm (learner,
optimizer, connectors, counters, RNGs), the remote env runner verifiably on the restored weights
right after the restore, and training continuing. Skipped when ray[rllib]'s dependencies are missing
(pip install "ray-ckpt[rllib]")."""
import collections
import runpy
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402
from ray_ckpt.integrations.rllib.base.conversion import _ITEMS  # noqa: E402
from ray_ckpt.integrations.rllib.env_runners import _runner_module_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# the lambdas below run inside the env runner actors, which cannot import this test module
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---------------------------------------------------------------- conversions (no Ray)
def test_storable_roundtrip_keeps_rllib_state_exact():
    from ray.rllib.utils.serialization import _deserialize_ndarray, _serialize_ndarray

    mean = np.array([0.5, -1.25, 3.0, 1e-9])
    state = {
        "MeanStdFilter": {None: {"shape": np.array([4]), "de_mean_to_zero": True, "clip_by_value": 10.0,
                                 "running_stats": [{"num_pushes": 7, "mean_array": _serialize_ndarray(mean),
                                                    "sum_sq_diff_array": _serialize_ndarray(mean * 2)}]}},
        "od": collections.OrderedDict([("b", 1), ("a", (2, 3.5))]),
        "keys": {(1, "x"): "tuple key", True: "bool key", 3: "int key"},
        "ids": {"p0", "p1"},
        "__ray_ckpt_items__": "a key that looks like ours",
    }
    storable = rr.to_storable(state, "connectors")
    # what the engine stores: no None/tuple/bool keys, RLlib's np.save strings as real arrays
    from ray_ckpt.formats.tree import flatten, unflatten

    flat = flatten(storable, state_name="connectors")
    arrays = [bytearray(a.tobytes()) for a in flat.arrays]
    back = rr.from_storable(unflatten(flat.structure, arrays, flat.tables))
    rs = back["MeanStdFilter"][None]["running_stats"][0]
    assert np.array_equal(_deserialize_ndarray(rs["mean_array"]), mean)
    assert np.array_equal(_deserialize_ndarray(rs["sum_sq_diff_array"]), mean * 2)
    assert rs["num_pushes"] == 7 and back["MeanStdFilter"][None]["clip_by_value"] == 10.0
    assert type(back["od"]) is collections.OrderedDict and list(back["od"]) == ["b", "a"]
    assert back["od"]["a"] == (2, 3.5)
    assert back["keys"] == {(1, "x"): "tuple key", True: "bool key", 3: "int key"}
    assert back["ids"] == {"p0", "p1"}
    assert back["__ray_ckpt_items__"] == "a key that looks like ours"


def test_unsupported_rllib_object_is_refused_by_name_and_path():
    class Schedule:
        pass

    with pytest.raises(rc.UnsupportedTypeError) as ei:
        rr.to_storable({"learner": {"sched": [1, Schedule()]}}, "optimizer")
    msg = str(ei.value)
    assert "'optimizer'" in msg and "['learner']['sched'][1]" in msg and "Schedule" in msg
    assert "allow_pickle" in msg
    # opting in keeps the object for pickle instead of refusing it
    obj = Schedule()
    assert rr.to_storable({"s": obj}, "metrics", allow_pickle=True)["s"] is obj


def test_callback_settings_are_validated_up_front(tmp_path):
    with pytest.raises(rc.InvalidArgumentError, match="every"):
        rr.make_callback("r1", local_dir=str(tmp_path), every=0)
    with pytest.raises(rc.InvalidArgumentError, match="run name"):
        rr.make_callback("bad/name", local_dir=str(tmp_path))
    with pytest.raises(rc.InvalidArgumentError, match="on_busy"):
        rr.make_callback("r1", local_dir=str(tmp_path), on_busy="later")
    with pytest.raises(rc.InvalidArgumentError, match="needs settings"):
        rr.RayCkptCallback()
    import functools

    cb = functools.partial(rr.RayCkptCallback, "r2", local_dir=str(tmp_path), keep_last=2)()
    assert cb.settings.run == "r2" and cb.settings.keep_last == 2 and cb.engine is None
    cls = rr.make_callback("r1", local_dir=str(tmp_path), every=3)
    assert issubclass(cls, rr.RayCkptCallback) and cls.settings.every == 3
    assert cls().engine is None  # instantiating (as every env runner does) connects to nothing


# ---------------------------------------------------------------- PPO end to end
def _ppo_config(callback):
    """The example's PPO config (one definition of it), with its own seed."""
    example = runpy.run_path(str(ROOT / "examples" / "rllib_example.py"), run_name="rllib_example_config")
    return example["build_config"](callback, seed=7)


def _learner(algo, inference_only=False):
    return algo.learner_group.get_state(components=["learner/rl_module", "learner/optimizer"],
                                        inference_only=inference_only)["learner"]


def _remote(algo, fn):
    return algo.env_runner_group.foreach_env_runner(fn, local_env_runner=False, timeout_seconds=60)


def _connectors(runner):
    return rr.to_storable(runner.get_state(components=["env_to_module_connector"])["env_to_module_connector"])


def _wait_for_states(engine, version, names, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        meta = next(m for m in engine.list_checkpoints() if m.version == version)
        if names <= set(meta.states) or time.monotonic() > deadline:
            assert names <= set(meta.states), (meta.states, meta.missing, meta.pending, engine.status(),
                                               engine.registered)
            return meta
        time.sleep(0.2)


def _assert_params_equal(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def _assert_tree_equal(a, b, path="state"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_tree_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.timeout(240)
def test_ppo_saved_by_callback_restores_into_fresh_algorithm(engine_factory, run_name, tmp_path):
    # the callback get-or-creates this same run (shut down by the fixture); its critical states are
    # small: one critical writer (a process fewer to start), the best-effort one as by default
    engine = engine_factory(critical_writers=1)
    cb = rr.make_callback(run_name, local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                          every=1)
    algo = _ppo_config(cb).build_algo()
    try:
        t0 = time.perf_counter()
        for _ in range(2):
            result = algo.train()
        train_s = time.perf_counter() - t0
        assert algo.iteration == 2 and result["ray_ckpt"]["last_saved_iteration"] == 2
        callback = rr.find_callback(algo)
        saved = rr.wait_for_saves(algo, timeout=120)
        assert sorted(saved) == [1, 2] and not callback.skipped and not callback.failures
        # the handles it keeps (one per version, for the whole run) hold none of their snapshots:
        # no objects in this process, nothing pinned in the object store
        with pytest.raises(rc.InvalidArgumentError, match="released"):
            callback.saves[1].refs("counters")
        # the capture + save() call is the only pause train() saw
        assert max(callback.save_call_ms) < 1000 * train_s
        meta = engine.list_checkpoints()[-1]
        assert meta.version == 2 and meta.step == 2
        assert {"policy", "optimizer", "connectors", "counters", "rng"} <= set(meta.states)
        # best-effort parts (metrics, the env runner's RNG states) may land just after the commit
        meta = _wait_for_states(engine, 2, {"metrics", "env_runner_1"})

        want = _learner(algo)
        want_conn = _connectors(algo.env_runner)  # the merged filter state the algorithm holds
        want_steps = result["env_runners"]["num_env_steps_sampled_lifetime"]
        assert want_conn["MeanStdFilter"][_ITEMS][0][1]["running_stats"][0]["num_pushes"] > 0
    finally:
        algo.stop()

    fresh = _ppo_config(cb).build_algo()
    try:
        initial_remote = rr.env_runner_weights(fresh)[1]
        report = rr.restore_algorithm(fresh, run_name, timeout_s=60)
        # ---- right after the restore, before any train(): no sleep, no second chance
        remote_now = _remote(fresh, lambda r: (r.worker_index, _runner_module_state(r), _connectors(r),
                                               r.num_env_steps_sampled_lifetime))
        assert report.version == 2 and report.iteration == 2 and fresh.iteration == 2
        assert report.env_runners == {1: "verified"} and report.verified
        assert all(v == "restored (local)" for v in report.states.values()), report.states

        got = _learner(fresh)
        _assert_params_equal(got["rl_module"]["default_policy"], want["rl_module"]["default_policy"])
        _assert_tree_equal(rr.to_storable(got["optimizer"]), rr.to_storable(want["optimizer"]), "optimizer")

        inference = _learner(fresh, inference_only=True)["rl_module"]["default_policy"]
        assert len(remote_now) == 1
        idx, remote_weights, remote_conn, remote_steps = remote_now[0]
        assert idx == 1
        _assert_params_equal(remote_weights["default_policy"], inference)  # the REMOTE runner: restored
        assert any(not np.array_equal(initial_remote["default_policy"][k], inference[k]) for k in inference)
        _assert_tree_equal(remote_conn, want_conn, "remote MeanStdFilter")
        _assert_tree_equal(_connectors(fresh.env_runner), want_conn, "local MeanStdFilter")
        assert remote_steps == want_steps

        # the remote runner's own RNG streams came back too (best-effort state env_runner_1)
        saved_runner = engine.load(name="env_runner_1", version=2)
        runner_np = _remote(fresh, lambda r: __import__("numpy").random.get_state())[0]
        assert np.array_equal(runner_np[1], saved_runner["process_rng"]["numpy"][1])

        # ---- training continues from the restored counters; the callback keeps saving
        result = fresh.train()
        assert fresh.iteration == 3 and result["training_iteration"] == 3
        assert result["env_runners"]["num_env_steps_sampled_lifetime"] > want_steps
        rr.wait_for_saves(fresh, timeout=120)
        assert engine.list_checkpoints()[-1].version == 3

        # ---- rolling a running algorithm back: its runner's weights_seq_no is now above the
        # checkpoint's, which RLlib's own set_state would ignore; the helper still lands them
        v1 = engine.load(name="policy", version=1)["default_policy"]
        report = rr.restore_algorithm(fresh, run_name, version=1, timeout_s=60)
        assert report.version == 1 and fresh.iteration == 1 and report.verified
        _assert_params_equal(_learner(fresh)["rl_module"]["default_policy"], dict(v1))
        inference = _learner(fresh, inference_only=True)["rl_module"]["default_policy"]
        _assert_params_equal(rr.env_runner_weights(fresh)[1]["default_policy"], inference)
        result = fresh.train()  # iteration 2 again: versions only grow, so it is saved as version 4
        assert fresh.iteration == 2 and not rr.find_callback(fresh).skipped
        rr.wait_for_saves(fresh, timeout=120)
        assert [m.version for m in engine.list_checkpoints()][-1] == 4
        assert engine.load(name="counters", version=4)["training_iteration"] == 2
        assert rr.restore_algorithm(fresh, run_name).iteration == 2  # a resume brings back the newest state
    finally:
        fresh.stop()


@pytest.mark.timeout(240)
def test_a_learner_resumed_after_its_newest_version_was_lost_saves_past_it(engine_factory, run_name, tmp_path):
    """A version lost with its node (or rolled back behind the run's back) is no longer listed and
    its step is never used again. A learner that resumes from the version before it redoes that
    iteration and saves it as the next free version: before, the callback saved it under the lost
    step, which the engine refuses, and ``train()`` raised InvalidSaveError (goodput.py's RLlib
    job, a notice whose last version was lost with its node)."""
    import glob
    import shutil

    engine = engine_factory(remote_uri=None, critical_writers=1)
    algo = _ppo_config(rr.make_callback(run_name, every=1)).build_algo()
    try:
        for _ in range(3):
            algo.train()
        engine.wait_until_finished(timeout=120)
    finally:
        algo.stop()
    assert engine.all_steps() == [1, 2, 3]
    engine.shutdown(stop_coordinator=True)
    for d in glob.glob(str(tmp_path / "local" / "**" / "v000000000003"), recursive=True):
        shutil.rmtree(d)  # gone with its node's disk
    engine = engine_factory(remote_uri=None, critical_writers=1)
    assert engine.all_steps() == [1, 2] and engine.last_saved_step == 3

    algo = _ppo_config(rr.make_callback(run_name, every=1, resume=True)).build_algo()
    try:
        cb = rr.find_callback(algo)
        assert cb.resumed.version == 2 and algo.iteration == 2
        algo.train()  # iteration 3 again: saved as version 4
        engine.wait_until_finished(timeout=120)
    finally:
        algo.stop()
    assert engine.all_steps() == [1, 2, 4]
    assert engine.load("counters", step=4)["training_iteration"] == 3  # the iteration redone, as version 4


def test_a_local_learners_state_is_saved_as_it_was_at_save(engine_factory, run_name, tmp_path):
    """The callback puts a local learner's weights and optimizer into the object store on a
    background thread (train() does not wait for that copy), with no fence: what is stored is still
    the state at save(), though the learner changes its parameters and moments in place before the
    copy runs (held here until after the change). It holds because RLlib's get_state returns copies."""
    import torch
    from ray_ckpt.capture.overlap import process_copier

    engine = engine_factory(critical_writers=1)
    cb = rr.make_callback(run_name, local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                          every=1 << 30)  # no save inside train(): the test calls save()
    algo = _ppo_config(cb).build_algo()
    try:
        algo.train()  # the optimizer has moments
        callback = rr.find_callback(algo)
        callback.save(algo).wait(timeout=120)  # the first overlapped snapshot starts the copy thread
        want = rr.to_storable(_learner(algo))
        learner = algo.learner_group._learner
        optimizers = list(learner._named_optimizers.values())
        copier = process_copier()
        assert copier is not None and optimizers
        with copier.held():  # the background copies begin when this block ends
            handle = callback.save(algo)
            with torch.no_grad():
                for p in learner.module["default_policy"].parameters():
                    p.add_(1.0)
                for opt in optimizers:
                    for st in opt.state.values():
                        for t in st.values():
                            if torch.is_tensor(t) and t.dim():
                                t.add_(1.0)
        handle.wait(timeout=120)
        _assert_params_equal(engine.load("policy", handle.step)["default_policy"],
                             want["rl_module"]["default_policy"])
        _assert_tree_equal(engine.load("optimizer", handle.step), want["optimizer"], "optimizer")
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rllib_example_runs(ray_session, tmp_path, capsys):
    mod = runpy.run_path(str(ROOT / "examples" / "rllib_example.py"), run_name="rllib_example_under_test")
    assert mod["main"](["--iterations", "1", "--dir", str(tmp_path)]) == 0  # 1 saved, restored, 1 more
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ")}
    assert rows["weights equal"] == "yes" and rows["training continued"] == "yes", out
    assert rows["saves"] == "1", out
