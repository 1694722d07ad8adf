"""RLlib with remote learners (``num_learners=1``, a real learner actor on CPU): the callback captures
``policy`` / ``optimizer`` / ``metrics`` inside the learner actor (the algorithm's process fetches no
learner state while saving), a restore pushes them into every learner and checks each one's answer,
and versions move between ``num_learners=0`` and ``num_learners=1`` both ways."""
import time

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402
from ray_ckpt.integrations.rllib import learners as lr  # noqa: E402


def _config(callback, num_learners: int, seed: int = 3):
    """The example's tiny PPO (CartPole, one env runner), with ``num_learners`` learner actors on half
    a CPU each (the session's Ray has 4 CPUs)."""
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module import MeanStdFilter

    return (PPOConfig()
            .environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.25, num_envs_per_env_runner=1,
                         env_to_module_connector=lambda env, spaces=None, device=None: MeanStdFilter())
            .learners(num_learners=num_learners, num_cpus_per_learner=0.5)
            .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=1)
            .callbacks(callback)
            .debugging(seed=seed))


def _learner_state(algo):
    """Weights + optimizer of the algorithm's (first) learner, as RLlib's LearnerGroup reads them."""
    st = algo.learner_group.get_state(components=["learner/rl_module", "learner/optimizer"])["learner"]
    return st["rl_module"], rr.to_storable(st["optimizer"])


def _assert_same_learner(algo, weights, optimizer):
    got_w, got_o = _learner_state(algo)
    assert sorted(got_w) == sorted(weights)
    for mid in weights:
        assert sorted(got_w[mid]) == sorted(weights[mid]), mid
        for k in weights[mid]:
            assert np.array_equal(got_w[mid][k], weights[mid][k]), (mid, k)
    assert lr.state_digest(got_o) == lr.state_digest(optimizer)


def _assert_runner_has_learner_weights(algo):
    inference = algo.learner_group.get_state(components="learner/rl_module", inference_only=True)[
        "learner"]["rl_module"]["default_policy"]
    remote = rr.env_runner_weights(algo)[1]["default_policy"]
    assert sorted(remote) == sorted(inference)
    for k in inference:
        assert np.array_equal(remote[k], inference[k]), k


def _callback(run_name, tmp_path):
    return rr.make_callback(run_name, local_dir=str(tmp_path / "local"), remote_uri=f"file://{tmp_path / 'remote'}",
                            every=1)


class _CountFetches:
    """Counts ``learner_group.get_state`` calls made while the callback's ``save()`` runs (a real
    wrapper around the algorithm's own LearnerGroup method; RLlib's per-iteration weight sync to the
    env runners also calls it, outside the save)."""

    def __init__(self, algo, callback):
        self.in_save = 0
        self.outside = 0
        self._saving = False
        lg_get, cb_save = algo.learner_group.get_state, callback.save

        def get_state(*a, **kw):
            if self._saving:
                self.in_save += 1
            else:
                self.outside += 1
            return lg_get(*a, **kw)

        def save(*a, **kw):
            self._saving = True
            try:
                return cb_save(*a, **kw)
            finally:
                self._saving = False

        algo.learner_group.get_state = get_state
        callback.save = save


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_remote_learner_state_is_captured_in_the_learner_and_restored_into_every_learner(
        engine_factory, run_name, tmp_path):
    engine = engine_factory(critical_writers=1)
    cb = _callback(run_name, tmp_path)
    algo = _config(cb, num_learners=1).build_algo()
    try:
        assert algo.learner_group.is_remote and lr.learner_ids(algo.learner_group) == [0]
        callback = rr.find_callback(algo)
        fetches = _CountFetches(algo, callback)
        for _ in range(2):
            result = algo.train()
        assert result["ray_ckpt"]["last_saved_iteration"] == 2
        # train() waits for no learner transfer: the save fetched nothing from the learner (before: one
        # learner_group.get_state, i.e. a blocking ray.get of the whole learner state, per save)
        assert fetches.in_save == 0 and fetches.outside >= 1, vars(fetches)
        assert rr.wait_for_saves(algo, timeout=120).keys() == {1, 2}
        assert not callback.failures and not callback.skipped
        want_w, want_o = _learner_state(algo)  # no training since the save of iteration 2
        # what version 2 holds came from the learner actor: its weights and optimizer state exactly
        saved = engine.load(name="policy", version=2)
        for k, v in want_w["default_policy"].items():
            assert np.array_equal(saved["default_policy"][k], v), k
        assert lr.state_digest(engine.load(name="optimizer", version=2)) == lr.state_digest(want_o)
        deadline = time.monotonic() + 60
        while "metrics" not in next(m for m in engine.list_checkpoints() if m.version == 2).states:
            assert time.monotonic() < deadline, "the best-effort metrics part never landed"
            time.sleep(0.2)
        metrics = engine.load(name="metrics", version=2)
        assert metrics["algorithm"] and metrics["learner"]  # both halves: the learner's read in the learner
        assert engine.load(name="counters", version=2)["weights_seq_no"] >= 2
    finally:
        algo.stop()

    # ---- a fresh num_learners=1 algorithm: pushed into every learner, each one's answer checked
    fresh = _config(cb, num_learners=1, seed=11).build_algo()
    local = None
    try:
        report = rr.restore_algorithm(fresh, run_name, timeout_s=60)
        assert report.version == 2 and report.learners == {0: "verified"} and report.env_runners == {1: "verified"}
        _assert_same_learner(fresh, want_w, want_o)
        _assert_runner_has_learner_weights(fresh)

        # a learner that cannot hold the version is named, not skipped
        bad = {"policy": {"default_policy": {k: v[:1] for k, v in want_w["default_policy"].items()}}}
        with pytest.raises(rc.RestoreError, match=r"learner 0: failed: .*size mismatch"):
            lr.restore_remote_learners(fresh.learner_group, bad, None, timeout_s=60)

        # ---- and vice versa: the same version into a local learner (num_learners=0) ...
        local = _config(cb, num_learners=0, seed=12).build_algo()
        report = rr.restore_algorithm(local, run_name, timeout_s=60)
        assert report.version == 2 and report.learners == {} and report.verified
        _assert_same_learner(local, want_w, want_o)
        _assert_runner_has_learner_weights(local)

        # ... which trains on and saves version 3 from its local learner; that version goes back into
        # the remote learner
        local.train()
        assert rr.wait_for_saves(local, timeout=120).keys() == {3}
        want_w, want_o = _learner_state(local)
        report = rr.restore_algorithm(fresh, run_name, timeout_s=60)
        assert report.version == 3 and report.iteration == 3
        assert report.learners == {0: "verified"} and report.verified
        _assert_same_learner(fresh, want_w, want_o)
        _assert_runner_has_learner_weights(fresh)
    finally:
        fresh.stop()
        if local is not None:
            local.stop()


def test_a_learner_holding_other_state_is_named():
    """The verdicts over the learners' answers (no Ray: the answers as the learners give them)."""
    a = {"default_policy": {"w": np.arange(4, dtype=np.float32)}}
    b = {"default_policy": {"w": np.arange(4, dtype=np.float32) + 1}}
    opt = {"o": {"module_id": "default_policy", "state": {"state": {0: {"step": np.float32(3)}}}}}
    good = {"weights_seq_no": 7, "policy": lr.state_digest(a), "optimizer": lr.state_digest(opt)}
    answers = {0: good, 1: dict(good, policy=lr.state_digest(b)), 2: dict(good, weights_seq_no=6),
               3: "no answer within 5s"}
    verdicts = lr._verdicts(answers, {"policy": lr.state_digest(a), "optimizer": lr.state_digest(opt)}, 7)
    assert verdicts[0] == "verified"
    assert verdicts[1] == "holds other weights than the version's 'policy'"
    assert verdicts[2] == "holds weights_seq_no 6, pushed 7"
    assert verdicts[3] == "no answer within 5s"
    # nothing pushed for a state: the learners must agree with each other
    verdicts = lr._verdicts({0: good, 1: dict(good, policy=lr.state_digest(b))}, {"policy": None,
                                                                                 "optimizer": None}, 7)
    assert verdicts == {0: "verified", 1: "holds other weights than the other learners"}
    # the digest sees dtype, shape, keys and values, not the container kind
    assert lr.state_digest(a) != lr.state_digest({"default_policy": {"w": np.arange(4, dtype=np.float64)}})
    assert lr.state_digest([1, (2.0, "x")]) == lr.state_digest((1, [2.0, "x"]))
    assert lr.state_digest({"k": 1}) != lr.state_digest({"k": 1.0})
