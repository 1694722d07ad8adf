"""RLlib replay buffers (integrations/rllib/replay/): every new-API-stack EpisodeReplayBuffer class
Ray ships, captured as rows (one per stored timestep, stable increasing row ids) + a meta state,
stored through ray_ckpt's real formats and restored into a fresh buffer that then samples exactly
as the original; DQN (prioritized, CartPole) and SAC (Pendulum) saved by the callback and restored
into a fresh Algorithm. Real RLlib, real episodes, real Ray; CPU only."""
import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import gymnasium as gym  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import (EpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,  # noqa: E402
                                            MultiAgentPrioritizedEpisodeReplayBuffer,
                                            PrioritizedEpisodeReplayBuffer)

import ray_ckpt as rc  # noqa: E402
from ray_ckpt.storage.checkpoint_io import decode_files, read_files, write_flat  # noqa: E402
from ray_ckpt.formats.tree import flatten  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402
from ray_ckpt.integrations.rllib.replay import (compare, incremental_capture, incremental_priorities,  # noqa: E402
                                                incremental_restore, row_ids, segment_trees,
                                                two_state)
from ray_ckpt.storage.tier import Tier  # noqa: E402


@pytest.fixture(autouse=True)
def _format_5(monkeypatch):
    """This module tests formats /1, /4 and /5 (``replay`` + ``replay_meta``), which the callback
    writes only when asked to: the journal (format /6, the default) is tests/test_rllib_replay_journal.py's."""
    from ray_ckpt.integrations.rllib.replay import algorithm as replay_algorithm
    monkeypatch.setattr(replay_algorithm, "REPLAY_FORMAT", 5)

ID_COLS = ("row_id", "episode", "t", "tree", "agent", "module")


# ---------------------------------------------------------------- real episodes
def _sa_chunks(seed, n_envs=3, steps=60, chunk=7, nested=False):
    """Episode chunks as env runners hand them to the buffer: three envs stepping in turn, chunks of
    at most ``chunk`` steps (running episodes continue in a later chunk, with a lookback of 1),
    numpy'ized; some infos not empty; extra model outputs; optionally a Dict observation space."""
    rng = np.random.default_rng(seed)
    if nested:
        osp = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32),
                               "img": gym.spaces.Box(0, 255, (2, 3), np.uint8)})
        osp.seed(seed)
    else:
        osp = gym.spaces.Box(-5, 5, (4,), np.float32)
    asp = gym.spaces.Discrete(3)

    def obs():
        return osp.sample() if nested else rng.standard_normal(4).astype(np.float32)

    def new_episode():
        ep = SingleAgentEpisode(observation_space=osp, action_space=asp)
        ep.add_env_reset(observation=obs(), infos={})
        return ep

    eps = [new_episode() for _ in range(n_envs)]
    out = []
    for step in range(steps):
        for e in range(n_envs):
            ep = eps[e]
            done = rng.random() < 0.06
            ep.add_env_step(observation=obs(), action=int(rng.integers(3)), reward=float(rng.random()),
                            infos={"step": step} if step % 5 == 0 else {}, terminated=done,
                            extra_model_outputs={"action_logp": np.float32(rng.random()),
                                                 "q": rng.standard_normal(3).astype(np.float32)})
            if done or len(ep) >= chunk:
                nxt = new_episode() if done else ep.cut(len_lookback_buffer=1)
                out.append(ep.to_numpy())
                eps[e] = nxt
    return out


_MA_CHUNKS = {}


def _ma_chunks():
    """Multi-agent episode chunks sampled by RLlib's own MultiAgentEnvRunner (two agents, two
    modules, random actions): agents' episodes end at different times."""
    if "c" not in _MA_CHUNKS:
        from ray.rllib.algorithms.ppo import PPOConfig
        from ray.rllib.env.multi_agent_env_runner import MultiAgentEnvRunner
        from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
        cfg = (PPOConfig().environment(MultiAgentCartPole, env_config={"num_agents": 2})
               .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=_ma_mapping)
               .env_runners(rollout_fragment_length=20).debugging(seed=0))
        runner = MultiAgentEnvRunner(config=cfg)
        chunks = []
        for _ in range(8):
            chunks += runner.sample(num_timesteps=20, random_actions=True)
        runner.stop()
        _MA_CHUNKS["c"] = chunks
    return _MA_CHUNKS["c"]


def _ma_mapping(aid, episode, **kw):
    return f"p{aid}"


BUFFERS = {
    "plain": (EpisodeReplayBuffer, {}, False),
    "prioritized": (PrioritizedEpisodeReplayBuffer, {"alpha": 0.6}, False),
    "multi_agent": (MultiAgentEpisodeReplayBuffer, {}, True),
    "multi_agent_prioritized": (MultiAgentPrioritizedEpisodeReplayBuffer, {"alpha": 0.6}, True),
}


def _fill(buf, chunks, prioritized, multi_agent, start=0, stop=None, seed=0):
    """Add the chunks a few at a time; a prioritized buffer is sampled and its priorities updated
    in between (as DQN does), so the trees hold more than the initial priority."""
    stop = len(chunks) if stop is None else stop
    for i in range(start, stop, 3):
        buf.add(chunks[i:min(i + 3, stop)])
        if prioritized and buf.get_num_timesteps() > 20:
            buf.sample(8, n_step=1)
            rng = np.random.default_rng(seed + i)
            dtype = np.float32 if i % 2 else np.float64  # tree leaves of both numpy types + Python floats
            if multi_agent:
                for m, last in list(buf._module_to_last_sampled_indices.items()):
                    if last:
                        buf.update_priorities(rng.random(len(last)).astype(dtype) * 3, module_id=m)
            else:
                buf.update_priorities(rng.random(8).astype(dtype) * 3)


def _make(name, capacity, seed=1):
    cls, kw, _ = BUFFERS[name]
    buf = cls(capacity=capacity, **kw)
    buf.rng = np.random.default_rng(seed)
    return buf


def _chunks_for(name, nested=False):
    return _ma_chunks() if BUFFERS[name][2] else _sa_chunks(0, nested=nested)


def _through_storage(tmp_path, name, state):
    """``state`` written and read back by ray_ckpt's own formats and a local tier (verified)."""
    tier = Tier(str(tmp_path / "tier"), "local")
    files = write_flat(tier, 1, name, 0, flatten(state, state_name=name))
    bufs, _, _ = read_files([tier], files)
    return files, decode_files(files, bufs, name=name)


def _sampled(buf, multi_agent):
    """What a learner would get: one sample with random n-steps (draws from the buffer's rng)."""
    kw = {} if isinstance(buf, PrioritizedEpisodeReplayBuffer) or multi_agent else {"sample_episodes": True}
    eps = buf.sample(16, n_step=(1, 3), include_infos=True, include_extra_model_outputs=True, **kw)
    out = []
    for e in eps:
        st = e.get_state()
        st.pop("id_", None)  # the prioritized buffers give each sampled episode a new uuid
        out.append(st)
    return out


def _assert_same(a, b, what):
    diffs = []
    compare._cmp(a, b, what, diffs)
    assert not diffs, diffs


# ---------------------------------------------------------------- without an Algorithm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(BUFFERS))
def test_every_buffer_class_round_trips_exactly_and_samples_the_same(name, tmp_path):
    cls, kw, multi_agent = BUFFERS[name]
    prioritized = "prioritized" in name
    for nested in ((False, True) if not multi_agent else (False,)):
        buf = _make(name, capacity=120)
        _fill(buf, _chunks_for(name, nested), prioritized, multi_agent)
        assert buf.get_num_episodes_evicted() > 0  # evictions happened: rows were removed

        replay, meta = two_state.capture_replay(buf)
        files, replay_back = _through_storage(tmp_path / f"r{nested}", "replay", replay)
        _, meta_back = _through_storage(tmp_path / f"m{nested}", "replay_meta", meta)
        # the rows are a ray_ckpt buffer: one Arrow IPC file, one row per stored timestep
        assert [f.role for f in files] == ["buffer"]
        n = len(replay["row_id"])
        want_rows = buf._num_agent_timesteps if multi_agent else buf.get_num_timesteps()
        assert n == want_rows and all(len(v) == n for v in replay.values() if isinstance(v, np.ndarray))
        assert np.all(np.diff(replay["row_id"]) > 0)
        assert ("obs/img" in replay and "obs/pos" in replay) if nested else replay["obs"].shape[1:] == (4,)

        fresh = cls(capacity=120, **kw)
        two_state.restore_replay(fresh, replay_back, meta_back, agent_to_module_mapping_fn=_ma_mapping)
        assert len(fresh) == len(buf) and fresh.get_num_timesteps() == buf.get_num_timesteps()
        assert fresh.get_num_episodes() == buf.get_num_episodes()
        assert fresh.get_added_timesteps() == buf.get_added_timesteps()
        # every attribute: episodes (data, lookbacks, infos, spaces), indices, counters, trees
        # (values and their Python/numpy types), free nodes, the sampling generator, metrics
        assert compare.buffer_state_equal(buf, fresh) == []
        # the next samples are the same batches, and both buffers are in the same state afterwards
        for _ in range(2):
            _assert_same(_sampled(buf, multi_agent), _sampled(fresh, multi_agent), "sample")
        assert compare.buffer_state_equal(buf, fresh) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["prioritized", "multi_agent_prioritized"])
def test_rows_are_append_only_across_captures_and_restores(name):
    """A row id never changes its row; new rows get larger ids; evicted rows simply disappear; a
    restored buffer continues the ids (so the next version writes only its new rows)."""
    prioritized, multi_agent = True, BUFFERS[name][2]
    chunks = _chunks_for(name)
    half = len(chunks) // 2
    capacity = 150 if multi_agent else 90
    buf = _make(name, capacity)
    _fill(buf, chunks, prioritized, multi_agent, 0, half)
    r1, m1 = two_state.capture_replay(buf)
    restored = BUFFERS[name][0](capacity=capacity, **BUFFERS[name][1])
    two_state.restore_replay(restored, r1, m1, agent_to_module_mapping_fn=_ma_mapping)
    _fill(buf, chunks, prioritized, multi_agent, half, None, seed=7)
    _fill(restored, chunks, prioritized, multi_agent, half, None, seed=7)
    assert buf.get_num_episodes_evicted() > m1["counters"]["_num_episodes_evicted"]  # more evictions
    r2, m2 = two_state.capture_replay(buf)
    r2b, _ = two_state.capture_replay(restored)

    common, i1, i2 = np.intersect1d(r1["row_id"], r2["row_id"], return_indices=True)
    assert 0 < len(common) < len(r1["row_id"])  # some rows survived, some were evicted
    for col, v in r1.items():
        if isinstance(v, np.ndarray) and col != "row_id":
            assert np.array_equal(v[i1], r2[col][i2]), col
    new = np.setdiff1d(r2["row_id"], r1["row_id"])
    assert len(new) > 0 and new.min() > r1["row_id"].max()
    # the restored buffer, given the same episodes, names every row as the original does
    assert set(r2) == set(r2b)
    for col, v in r2.items():
        assert np.array_equal(v, r2b[col]) if isinstance(v, np.ndarray) else v == r2b[col], col


@pytest.mark.parametrize("tree_cls", ["SumSegmentTree", "MinSegmentTree"])
def test_trees_rebuilt_from_row_leaves_equal_rllibs_incremental_ones(tree_cls):
    """Inner nodes recomputed from the leaves (numpy, level by level, for float64 leaves; Python
    otherwise) equal those RLlib's __setitem__ left, value and type, after sets and frees."""
    from ray.rllib.execution import segment_tree
    cls = getattr(segment_tree, tree_cls)
    rng = np.random.default_rng(0)
    for leaf_types in ((float, np.float64), (float, np.float64, np.float32)):
        tree = cls(64)
        used = {}
        for _ in range(300):
            i = int(rng.integers(64))
            if i in used and rng.random() < 0.3:  # freed, as RLlib frees an evicted row's node
                tree[i] = tree.neutral_element
                del used[i]
            else:
                used[i] = leaf_types[int(rng.integers(len(leaf_types)))](rng.random() * 3)
                tree[i] = used[i]
        idx = np.array(sorted(used), np.int64)
        again = cls(64)
        segment_trees._rebuild_tree(again, idx, segment_trees._tree_leaves(tree, idx, "t"))
        assert again.value[1:] == tree.value[1:]
        assert [type(x) for x in again.value[1:]] == [type(x) for x in tree.value[1:]]


def test_unsupported_buffers_are_refused_by_name():
    from ray.rllib.utils.replay_buffers import ReplayBuffer
    with pytest.raises(rc.UnsupportedTypeError,
                       match=r"ray\.rllib\.utils\.replay_buffers\.replay_buffer\.ReplayBuffer is not supported"):
        two_state.capture_replay(ReplayBuffer(capacity=10))

    class WithState(EpisodeReplayBuffer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.extra_counter = 3                    # plain: kept
            self.sampler = lambda: None               # not storable: refused by name
    buf = WithState(capacity=50)
    with pytest.raises(rc.UnsupportedTypeError, match=r"WithState: attribute 'sampler'"):
        two_state.capture_replay(buf)
    del buf.sampler
    _, meta = two_state.capture_replay(buf)
    assert meta["extra_attrs"] == {"extra_counter": 3}


def test_restore_into_a_buffer_of_another_capacity_or_type_fails_and_changes_nothing():
    buf = _make("prioritized", capacity=120)
    _fill(buf, _sa_chunks(0), True, False)
    replay, meta = two_state.capture_replay(buf)
    other = PrioritizedEpisodeReplayBuffer(capacity=200, alpha=0.6)
    with pytest.raises(rc.RestoreError, match="capacity is 200 here but 120 in the checkpoint"):
        two_state.restore_replay(other, replay, meta)
    assert other.get_num_timesteps() == 0 and not other.episodes
    with pytest.raises(rc.RestoreError, match="PrioritizedEpisodeReplayBuffer.*EpisodeReplayBuffer"):
        two_state.restore_replay(EpisodeReplayBuffer(capacity=120), replay, meta)


# ---------------------------------------------------------------- real algorithms
def _dqn_config(cb, seed=3):
    from ray.rllib.algorithms.dqn import DQNConfig
    return (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=32)
            .training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 300,
                                            "alpha": 0.6, "beta": 0.4},
                      num_steps_sampled_before_learning_starts=64, train_batch_size=32)
            .rl_module(model_config={"fcnet_hiddens": [32]})
            .reporting(min_sample_timesteps_per_iteration=100)
            .callbacks(cb).debugging(seed=seed))


def _sac_config(cb, seed=3):
    from ray.rllib.algorithms.sac import SACConfig
    return (SACConfig().environment("Pendulum-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=16)
            .training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 500,
                                            "alpha": 0.6, "beta": 0.4},
                      num_steps_sampled_before_learning_starts=64, train_batch_size=16)
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .reporting(min_sample_timesteps_per_iteration=200)  # Pendulum's episodes: 200 steps
            .callbacks(cb).debugging(seed=seed))


def _replay_sample(algo):
    """The sample DQN's / SAC's training_step draws from the buffer (same arguments)."""
    cfg = algo.config
    return algo.local_replay_buffer.sample(num_items=cfg.total_train_batch_size, n_step=cfg.n_step,
                                           gamma=cfg.gamma, beta=cfg.replay_buffer_config.get("beta"),
                                           sample_episodes=True)


def _episodes_state(eps):
    out = []
    for e in eps:
        st = e.get_state()
        st.pop("id_")
        out.append(st)
    return out


def _numpy(x):
    """Tensors as NumPy arrays, throughout a tree (to compare a live state with a loaded one)."""
    import torch
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_numpy(v) for v in x)
    return x.numpy() if isinstance(x, torch.Tensor) else x


def _learner_state(algo):
    """The learner's whole state a restore promises back: every module parameter (target networks,
    SAC's log_alpha included) and every optimizer (moments, steps, param groups), storable."""
    st = algo.learner_group.get_state(components=["learner/rl_module", "learner/optimizer"])["learner"]
    # SAC's entropy temperature is a learner attribute, in no RLlib get_state
    [alpha] = [r.get() for r in algo.learner_group.foreach_learner(
        lambda learner: {m: v.detach().numpy().copy() for m, v in getattr(learner, "curr_log_alpha", {}).items()})]
    return rr.to_storable({"rl_module": st["rl_module"], "optimizer": st["optimizer"], "log_alpha": alpha})


def _run_and_restore(make_config, engine_factory, run_name, iterations, rollback=False, learner_check=None):
    engine = engine_factory(critical_writers=1)
    # connects to the engine created above; "wait": every iteration is saved however slow the disk
    cb = rr.make_callback(run_name, every=1, on_busy="wait")
    algo = make_config(cb).build_algo()
    try:
        for _ in range(iterations):
            algo.train()
        saved = rr.wait_for_saves(algo, timeout=120)
        assert sorted(saved) == list(range(1, iterations + 1))
        callback = rr.find_callback(algo)
        assert callback.engine.registered["replay"] is rc.Strategy.CRITICAL  # off-policy: "auto" = critical
        buf = algo.local_replay_buffer
        assert buf.get_num_episodes_evicted() > 0  # the buffer is full and evicting
        # rows are append-only across saves: a row id present in two versions holds the same row
        r_prev = engine.load(name="replay", version=iterations - 1)
        r_last = engine.load(name="replay", version=iterations)
        common, i1, i2 = np.intersect1d(r_prev["row_id"], r_last["row_id"], return_indices=True)
        assert len(common) > 0
        for col, v in r_prev.items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(v[i1], r_last[col][i2]), col
        assert np.setdiff1d(r_last["row_id"], r_prev["row_id"]).min() > r_prev["row_id"].max()
        assert len(r_last["row_id"]) == buf.get_num_timesteps()
        want_learner = _learner_state(algo)  # no update since the last iteration's save
        want_counters = engine.load(name="counters", version=iterations)
        if learner_check is not None:
            learner_check(want_learner)
    finally:
        algo.stop()  # the "preemption": the original buffer object stays here to compare with

    # the relaunched trainer: a fresh Algorithm whose callback resumes the run's latest version while
    # the Algorithm is built (restore_algorithm; the rollback below calls it directly)
    resume = rr.make_callback(run_name, every=1, on_busy="wait", resume=True)
    fresh = make_config(resume).build_algo()
    try:
        report = rr.find_callback(fresh).resumed
        assert report.version == iterations and fresh.iteration == iterations
        assert report.states["replay"] == "restored" and report.states["replay_meta"] == "restored"
        # the learner as it was at the save, bit for bit: weights, target networks, every optimizer
        _assert_same(_learner_state(fresh), want_learner, "learner")
        from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME
        sampled = fresh.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME))
        assert sampled == want_counters[NUM_ENV_STEPS_SAMPLED_LIFETIME] > 0
        # the process RNGs (Python, NumPy, torch) as saved with the version
        from ray_ckpt.capture.rng import rng_state
        _assert_same(_numpy(rr.to_storable(rng_state(), "rng")), _numpy(engine.load(name="rng", version=iterations)),
                     "rng")
        got = fresh.local_replay_buffer
        assert len(got) == len(buf) and got.get_num_timesteps() == buf.get_num_timesteps()
        assert got.get_num_episodes() == buf.get_num_episodes()
        assert got.get_num_episodes_evicted() == buf.get_num_episodes_evicted()
        # contents, priorities (both trees, leaf by leaf, with their types), free nodes, counters, rng
        assert compare.buffer_state_equal(buf, got) == []
        # the next batch the learner would draw from the restored buffer is the uninterrupted one's
        _assert_same(_episodes_state(_replay_sample(algo)), _episodes_state(_replay_sample(fresh)), "batch")
        assert compare.buffer_state_equal(buf, got) == []
        # training continues; the next version writes only the new rows (ids continue after the restore)
        fresh.train()
        rr.wait_for_saves(fresh, timeout=120)
        v_next = engine.list_checkpoints()[-1].version
        r_next = engine.load(name="replay", version=v_next)
        common, i1, i2 = np.intersect1d(r_last["row_id"], r_next["row_id"], return_indices=True)
        assert len(common) > 0 and np.array_equal(r_last["obs"][i1], r_next["obs"][i2])
        assert np.setdiff1d(r_next["row_id"], r_last["row_id"]).min() > r_last["row_id"].max()
        if rollback:
            # set back to an older version: its rows' ids may name other rows in the newest version,
            # so every row gets a new id above the newest's (the next save writes the buffer once)
            rr.restore_algorithm(fresh, engine, version=iterations - 1)
            fresh.train()
            rr.wait_for_saves(fresh, timeout=120)
            v_back = engine.list_checkpoints()[-1].version
            assert v_back == v_next + 1
            r_back = engine.load(name="replay", version=v_back)
            assert r_back["row_id"].min() > r_next["row_id"].max()
            want, _ = two_state.capture_replay(got, row_ids=row_ids.RowIds())  # the buffer as it is now, ids aside
            for col, v in want.items():
                if isinstance(v, np.ndarray) and col != "row_id":
                    assert np.array_equal(v, r_back[col]), col
    finally:
        fresh.stop()
    return buf, got


@pytest.mark.timeout(240)
def test_dqn_prioritized_buffer_saved_by_callback_restores_exactly(engine_factory, run_name):
    buf, got = _run_and_restore(_dqn_config, engine_factory, run_name, iterations=4, rollback=True)
    assert isinstance(got, PrioritizedEpisodeReplayBuffer)


@pytest.mark.slow  # 20-35 s: DQN's test covers the callback's replay path in the fast suite
@pytest.mark.timeout(240)
def test_sac_pendulum_buffer_saved_by_callback_restores_exactly(engine_factory, run_name):
    def sac_parts(learner):  # what makes SAC's learner SAC's: twin target Q networks, alpha and its optimizer
        params = learner["rl_module"]["default_policy"]
        assert any(k.startswith("target_qf") for k in params), sorted(params)
        assert learner["log_alpha"]["default_policy"] != 0.0  # trained away from initial_alpha=1.0
        assert {"default_policy_qf", "default_policy_qf_twin", "default_policy_policy",
                "default_policy_alpha"} <= set(learner["optimizer"]), sorted(learner["optimizer"])

    buf, got = _run_and_restore(_sac_config, engine_factory, run_name, iterations=3, learner_check=sac_parts)
    assert got.episodes[0].get_observations(0).shape == (3,)


@pytest.mark.timeout(180)
def test_replay_strategy_setting(engine_factory, run_name):
    with pytest.raises(rc.InvalidArgumentError, match="replay_strategy must be one of"):
        rr.make_callback(run_name, replay_strategy="sometimes")
    engine = engine_factory(critical_writers=1)
    cb = rr.make_callback(run_name, every=1, on_busy="wait", replay_strategy="off")
    algo = _dqn_config(cb).build_algo()
    try:
        algo.train()
        rr.wait_for_saves(algo, timeout=120)
        assert "replay" not in engine.list_checkpoints()[-1].states
        fresh = _dqn_config(cb).build_algo()
        try:
            report = rr.restore_algorithm(fresh, engine)
            assert report.states["replay"].startswith("missing: version 1 has no replay buffer")
            assert fresh.local_replay_buffer.get_num_timesteps() == 0
        finally:
            fresh.stop()
    finally:
        algo.stop()


@pytest.mark.timeout(180)
def test_best_effort_replay_that_cannot_be_captured_leaves_the_save_going(engine_factory, run_name):
    engine = engine_factory(critical_writers=1)
    cb = rr.make_callback(run_name, every=1, on_busy="wait", replay_strategy="best_effort")
    algo = _dqn_config(cb).build_algo()
    try:
        algo.train()
        rr.wait_for_saves(algo, timeout=120)
        assert rr.find_callback(algo).engine.registered["replay"] is rc.Strategy.BEST_EFFORT
        assert {"replay", "replay_meta"} <= set(_states_when_written(engine, 1))
        algo.local_replay_buffer.sampler = lambda: None  # a subclass-like attribute it cannot store
        algo.train()  # not an error: the buffer is best effort
        rr.wait_for_saves(algo, timeout=120)
        meta = engine.list_checkpoints()[-1]
        assert meta.version == 2 and "replay" not in meta.states and "policy" in meta.states
    finally:
        algo.stop()


def _states_when_written(engine, version, timeout=60):
    """A version's states once its best-effort parts have landed (they may follow the commit)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        meta = next(m for m in engine.list_checkpoints() if m.version == version)
        if not meta.pending or time.monotonic() > deadline:
            return meta.states
        time.sleep(0.2)


# ---------------------------------------------------------------- incremental capture (format /3)
def _store_version(tier, v, states, base):
    """Each state written as the engine's writers write it (append-only over ``base``) and read
    back verified: (files, read-back states, bytes written)."""
    from ray_ckpt.storage.checkpoint_io import write_append_only
    files, back, written = {}, {}, {}
    for n, st in states.items():
        flat = flatten(st, state_name=n)
        files[n], written[n] = write_append_only(tier, v, n, 0, flat, base.get(n, []))
        bufs, _, _ = read_files([tier], files[n])
        back[n] = decode_files(files[n], bufs, name=n)
    return files, back, written


def _same_states(a, b):
    """Equal states, the buffers' metrics aside (the metrics logger keeps throughput timings): the
    rows, the log's records before the meta record byte for byte, the meta records decoded."""
    assert set(a) == set(b) == {"replay", "replay_meta"}
    _assert_same(a["replay"], b["replay"], "replay")
    (ma, ra, _), (mb, rb, _) = (incremental_restore.read_log(a["replay_meta"]),
                                incremental_restore.read_log(b["replay_meta"]))
    ma.pop("metrics"), mb.pop("metrics")
    _assert_same(ma, mb, "replay_meta meta record")
    _assert_same(ra, rb, "replay_meta records")
    for k in ("next_chunk", "meta_at", "next_row_id", "n_rows", "dict_at", "dict_rows"):
        assert a["replay_meta"][k] == b["replay_meta"][k], k


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,compact", [("plain", False), ("prioritized", False), ("prioritized", True)])
def test_incremental_states_through_append_only_versions_restore_exactly(name, compact, tmp_path, monkeypatch):
    """Captured every few adds (with evictions and priority updates in between), the two states are
    written version after version as the engine writes them; each version restores into a fresh
    buffer exactly; a buffer restored from version 3 and fed the same since captures the same states
    as the uninterrupted one (its logs continue: same ids, same entries). ``compact``: the priority
    records are compacted at almost every save (the entries that differ from the rows' ``prio``, anew)."""
    prioritized = name == "prioritized"
    if compact:
        monkeypatch.setattr(incremental_priorities, "COMPACT_FACTOR", 0)
        monkeypatch.setattr(incremental_priorities, "COMPACT_MIN", 12)
    tier = Tier(str(tmp_path / "tier"), "local")
    chunks = _sa_chunks(0, steps=150)
    buf = _make(name, capacity=150)
    base, restored, step = {}, None, 6
    for v, i in enumerate(range(0, len(chunks), step), 1):
        for b in (buf, restored) if restored is not None else (buf,):
            _fill(b, chunks, prioritized, False, i, i + step, seed=v)
        states = incremental_capture.capture_states(buf, row_ids.row_ids_of(buf))
        assert set(states) == {"replay", "replay_meta"}
        files, back, _ = _store_version(tier, v, states, base)
        base = files
        if restored is not None:
            _same_states(states, incremental_capture.capture_states(restored, row_ids.row_ids_of(restored)))
        fresh = _make(name, capacity=150, seed=99)
        replay, meta, seeds = incremental_restore.states_to_v1(back)
        two_state.restore_replay(fresh, replay, meta)
        incremental_restore.seed(row_ids.row_ids_of(fresh), seeds, fresh)
        assert compare.buffer_state_equal(buf, fresh) == [], v
        if v == 3:
            restored = fresh
    assert buf.get_num_episodes_evicted() > 10
    if compact:  # one priority record at most is live: the older ones were replaced by compaction
        recs = incremental_restore.read_log(states["replay_meta"])[0]["priority"]["records"]
        assert len(recs) <= 1 and row_ids.row_ids_of(buf).inc.log_entries <= buf.get_num_timesteps()
    _assert_same(_sampled(buf, False), _sampled(restored, False), "sample")


def test_log_records_read_back_exactly_and_damage_is_named():
    """A ``replay_meta`` log record comes back as it was stored (integer arrays narrowed and
    shuffled, extreme values included); one of another kind, cut short, with a row too many, or
    compressed with a dictionary the reader was not given is refused with a RestoreError naming
    it, not misread."""
    from ray_ckpt.integrations.rllib.replay import incremental_state as st
    from ray_ckpt.integrations.rllib.replay import records
    i64 = np.iinfo(np.int64)
    state = {"noise": np.random.default_rng(0).integers(0, 255, 3000, dtype=np.uint8), "n": 7, "ids": ["a", "b"],
             "nested": {"x": np.arange(5, dtype=np.int32), "none": None},
             "steps": np.arange(10**12, 10**12 + 4000, 3, dtype=np.int64), "wrap": np.array([i64.max, i64.min, 0, -1]),
             "u": np.array([2**64 - 1, 0, 7], np.uint64), "f": np.random.default_rng(1).random(40),
             "grid": np.arange(12, dtype=np.int16).reshape(3, 4), "empty": np.zeros(0, np.int64),
             "b": np.array([True, False, True])}
    raw = st._raw(state)
    rows = st._encode(st.EPISODES, raw)
    assert rows.shape[1] == st.CHUNK and len(rows) > 3
    _assert_same(records._decode(rows, st.EPISODES, "batch 3"), state, "record")
    with pytest.raises(rc.RestoreError, match="batch 3: a record of kind 01, expected 3"):
        records._decode(rows, st.META, "batch 3")
    for bad in (rows[:-1], np.concatenate([rows, np.zeros((1, st.CHUNK), np.uint8)])):
        with pytest.raises(rc.RestoreError, match="batch 3: says"):
            records._decode(bad, st.EPISODES, "batch 3")
    zdict = raw[:2000]
    rows_d = st._encode(st.EPISODES, raw, zdict=zdict)
    assert len(rows_d) < len(rows)  # the dictionary holds most of the record: it costs what differs
    _assert_same(records._decode(rows_d, st.EPISODES, "batch 4", {records.dict_id(zdict): zdict}), state, "record")
    with pytest.raises(rc.RestoreError, match="batch 4: compressed with dictionary 0x[0-9a-f]{8}, which no live"):
        records._decode(rows_d, st.EPISODES, "batch 4", {})


def test_free_nodes_of_a_large_buffer_come_back_exactly():
    """A 1M-row buffer's free-node deque (~2M nodes) is stored as its freed nodes plus a range and
    comes back as it was, save after save as RLlib pops and frees nodes at the left; one whose end
    is not the range any more is stored whole."""
    import collections
    n = 2 * 2**20
    dq = collections.deque(range(n), maxlen=n)
    for step in range(5):
        for _ in range(500):
            dq.popleft()
        if step % 2:
            dq.appendleft(7 + step)
        st = segment_trees._free_nodes_state(dq)
        assert "all" not in st and st["stop"] == n
        assert segment_trees._free_nodes_from(st) == dq
    dq[-1] = 3
    st = segment_trees._free_nodes_state(dq)
    assert "all" in st and segment_trees._free_nodes_from(st) == dq


def test_record_bytes_are_those_of_ray_ckpts_flatten():
    """A record's bytes (its structure JSON, array forms and bytes) are what they were when built
    through ray_ckpt's flatten (records written before the faster walk read, and compress against
    their dictionaries, alike); a leaf the walk does not know still goes through flatten, which
    names what it cannot store."""
    import collections
    from ray_ckpt.integrations.rllib.replay import records
    state = {"a": [1.5, float("nan"), float("-inf"), -0.0, True, None, "x\u00e9\"", b"\x00\x01", 2**70],
             None: (1, 2), True: {3: np.float32(2.5), -4: np.bool_(True)}, False: np.int64(7),
             "od": collections.OrderedDict([("z", 1)]), "be": np.arange(12, dtype=">i4").reshape(3, 4),
             "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2], "empty": np.empty((0, 3), np.float32),
             "scalar": np.array(3.5), "b": np.array([True, False]), "f16": np.ones(5, np.float16),
             "u": np.array(["ab", "c"]), "big": np.array([-5, 3, 1 << 40]), "steps": np.arange(0, 3000, 3),
             "episodes": _sa_chunks(0, steps=20)[0].get_state()["observations"]}
    assert records._raw(state) == records._raw_generic(state)
    _assert_same(records._unraw(records._raw(state), "record"), records._unraw(records._raw_generic(state), "r"),
                 "record")
    with pytest.raises(rc.UnsupportedTypeError, match=r"\['s'\]"):
        records._raw({"s": {1, 2}})


@pytest.mark.timeout(300)
def test_incremental_save_writes_what_changed_not_the_buffer(tmp_path):
    """A prioritized buffer of ~4k rows, then versions that add ~30 timesteps and update 8
    priorities each: every version's bytes for the whole buffer (its new rows; the newly done
    episodes, the changed priorities and the meta in one log segment; the two indexes) stay a few KB,
    far below the buffer's own size, and do not grow with it; a version writes four files."""
    tier = Tier(str(tmp_path / "tier"), "local")
    chunks = _sa_chunks(1, steps=1500, chunk=50)
    buf = _make("prioritized", capacity=100_000)
    first = len(chunks) - 12
    _fill(buf, chunks, True, False, 0, first)
    base, per_version, dicts_at = {}, [], set()
    for v, i in enumerate(range(first, len(chunks), 2), 1):
        if v > 1:
            _fill(buf, chunks, True, False, i, i + 2, seed=v)
        states = incremental_capture.capture_states(buf, row_ids.row_ids_of(buf))
        base, back, written = _store_version(tier, v, states, base)
        per_version.append(written)
        own = [f for fs in base.values() for f in fs if f.path.startswith(f"v{v:012d}/")]
        assert len(own) == 4 or v == 1, own
        # the first save's dictionary record serves the later ones: no version writes another
        dicts_at.add(states["replay_meta"]["dict_at"])
        assert len(dicts_at) == 1, dicts_at
    n_rows = buf.get_num_timesteps()
    assert n_rows > 3000
    whole = sum(f.size for f in base["replay"] if f.role == "segment")
    for w in per_version[1:]:
        assert sum(w.values()) < 0.1 * whole, (w, whole)
        assert w["replay_meta"] < 12000, w
    fresh = _make("prioritized", capacity=100_000, seed=5)
    replay, meta, seeds = incremental_restore.states_to_v1(back)
    two_state.restore_replay(fresh, replay, meta)
    assert compare.buffer_state_equal(buf, fresh) == []


def test_equal_spaces_share_one_entry_and_unequal_ones_do_not():
    """Episodes arrive with their own space objects: equal ones share one table entry (not
    serialised per episode), and any difference in type, shape, dtype or bounds is a new entry
    that reads back as exactly that space."""
    import copy

    from ray_ckpt.integrations.rllib.replay.values import _Spaces

    box = gym.spaces.Box(-5, 5, (4,), np.float32)
    spaces = [box, gym.spaces.Discrete(3), gym.spaces.MultiDiscrete([2, 3]), gym.spaces.MultiBinary(4),
              gym.spaces.Dict({"img": gym.spaces.Box(0, 255, (2, 3), np.uint8), "k": gym.spaces.Discrete(2)}),
              gym.spaces.Tuple((gym.spaces.Discrete(2), box))]
    others = [gym.spaces.Box(-5, 5, (4,), np.float64), gym.spaces.Box(-5, np.nextafter(np.float32(5), 9), (4,),
                                                                      np.float32),
              gym.spaces.Box(-5, 5, (2, 2), np.float32), gym.spaces.Discrete(3, start=1), gym.spaces.MultiBinary(5)]
    table = _Spaces()
    codes = [table.code(s) for s in spaces]
    assert [table.code(copy.deepcopy(s)) for s in spaces] == codes and len(table.table) == len(spaces)
    more = [table.code(s) for s in others]
    assert len(set(codes + more)) == len(spaces) + len(others)
    back = _Spaces(table.table)
    for s, c in zip(spaces + others, codes + more):
        got = back.space(c)
        assert type(got) is type(s) and got == s
        if isinstance(s, gym.spaces.Box):
            assert got.dtype == s.dtype and np.array_equal(got.low, s.low) and np.array_equal(got.high, s.high)


def _arrays_of(state, where=""):
    """Every numpy array in a (nested) state, by path."""
    out = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_arrays_of(v, f"{where}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_arrays_of(v, f"{where}/{i}"))
    elif isinstance(state, np.ndarray):
        out[where] = state
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,n_envs", [("prioritized", 3), ("prioritized", 1), ("multi_agent_prioritized", None)])
def test_a_captures_arrays_never_change_after_it(name, n_envs):
    """What lets the callback copy the replay states into the object store on a background thread
    while train() goes on (registered with overlap=True): the arrays a capture returns are never
    changed afterwards -- not by the buffer's adds, evictions and priority updates, nor by the
    next captures, which build their arrays from them (and append to their memory: one env's
    evictions are a prefix of the rows, several envs' are spread among them)."""
    multi_agent = BUFFERS[name][2]
    chunks = _chunks_for(name) if multi_agent else _sa_chunks(0, n_envs=n_envs, steps=180 // n_envs)
    buf = _make(name, 150 if multi_agent else 90)
    rid = row_ids.row_ids_of(buf)
    taken = []
    step = max(3, len(chunks) // 6)
    for i in range(0, len(chunks), step):
        _fill(buf, chunks, True, multi_agent, i, min(i + step, len(chunks)), seed=i)
        arrays = _arrays_of(two_state.capture_log_states(buf, rid))
        assert arrays and any(len(a) > 0 for a in arrays.values())
        taken.append((arrays, {k: a.copy() for k, a in arrays.items()}))
    assert buf.get_num_episodes_evicted() > 0
    for n, (arrays, copies) in enumerate(taken):
        for k, a in arrays.items():
            assert np.array_equal(a, copies[k]), f"capture {n}: {k} changed after it was taken"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["plain", "prioritized"])
def test_a_full_buffers_capture_appends_to_the_previous_ones_rows_instead_of_copying_them(name):
    """One env runner's buffer at capacity evicts its oldest rows and gains new ones every save:
    the capture's row columns, ids and leaves then extend the previous capture's memory (only the
    new rows are copied), where before every row was copied several times per save (~90 ms at a
    1M-row DQN buffer). Checked as sharing memory; the bytes are checked by the test above and the
    round trips."""
    chunks = _sa_chunks(0, n_envs=1, steps=200)
    buf = _make(name, 90)
    rid = row_ids.row_ids_of(buf)
    prev, shared, evicting = None, [], []
    for i in range(0, len(chunks), 2):
        before = buf.get_num_episodes_evicted()
        _fill(buf, chunks, name == "prioritized", False, i, min(i + 2, len(chunks)), seed=i)
        replay = two_state.capture_log_states(buf, rid)["replay"]
        if prev is not None and buf.get_num_episodes_evicted() > before and len(replay["row_id"]) > 0:
            evicting.append(i)
            shared.append(all(np.shares_memory(replay[c], prev[c]) for c in ("row_id", "episode", "t")))
        prev = replay
    assert len(evicting) >= 5, "the buffer did not fill up"
    # the backing array is reallocated when its room runs out (every ~1000 rows here): rarely
    assert sum(shared) >= len(shared) - 1, f"captures at {evicting} shared memory: {shared}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["prioritized", "multi_agent_prioritized"])
def test_the_capture_keeps_no_done_episodes_parts_between_saves(name):
    """A capture caches the split parts of the episodes it must split again next time (the running
    ones) and nothing of the done ones: their rows and batch are saved, and a done episode gets no
    new rows. Kept, they were ~30 objects per live episode for the whole run (more and longer full
    garbage collections in train()); the saves restore exactly without them (the round-trip tests)."""
    multi_agent = BUFFERS[name][2]
    chunks = _chunks_for(name)
    buf = _make(name, 150 if multi_agent else 90)
    rid = row_ids.row_ids_of(buf)
    step = max(3, len(chunks) // 6)
    saw_done = False
    for i in range(0, len(chunks), step):
        _fill(buf, chunks, True, multi_agent, i, min(i + step, len(chunks)), seed=i)
        two_state.capture_log_states(buf, rid)
        cached = {k for k, _ in rid.parts}
        running = set(rid.inc.open_keys)
        assert cached == running, f"cached parts of episodes {sorted(cached - running)} that are done"
        saw_done |= len(rid.inc.logged) > 0
    assert saw_done and buf.get_num_episodes_evicted() > 0
