"""RLlib replay buffers (integrations/rllib/replay/) with real algorithms: SAC (Pendulum) saved by
the callback and resumed exactly; the replay_strategy setting; a best-effort buffer that cannot be
saved; buffers the journal does not keep refused by name; a version written before the journal
refused on restore, naming ``ray-ckpt migrate``. Also the shared helpers of the replay tests: real
episode chunks (single-agent, and multi-agent from RLlib's own env runner), the four buffer
classes, DQN / SAC configs. Real RLlib, real episodes, real Ray; CPU only."""
import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("ray.rllib")

import gymnasium as gym  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers import (EpisodeReplayBuffer, MultiAgentEpisodeReplayBuffer,  # noqa: E402
                                            MultiAgentPrioritizedEpisodeReplayBuffer,
                                            PrioritizedEpisodeReplayBuffer)

import replay_compare  # noqa: E402
import ray_ckpt as rc  # noqa: E402
from ray_ckpt.storage.checkpoint_io import decode_files, read_files  # noqa: E402
from ray_ckpt.formats.tree import flatten  # noqa: E402
from ray_ckpt.integrations import rllib as rr  # noqa: E402
from ray_ckpt.integrations.rllib.replay import journal as jn  # noqa: E402
from ray_ckpt.integrations.rllib.replay.trees import rebuild_tree  # noqa: E402
from ray_ckpt.integrations.rllib.replay.values import pack_scalars  # noqa: E402


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
    replay_compare._cmp(a, b, what, diffs)
    assert not diffs, diffs


@pytest.mark.parametrize("tree_cls", ["SumSegmentTree", "MinSegmentTree"])
def test_trees_rebuilt_from_row_leaves_equal_rllibs_incremental_ones(tree_cls):
    """Inner nodes recomputed from the leaves (numpy, level by level, for float64 leaves; Python
    otherwise) equal those RLlib's __setitem__ left, value and type, after sets and frees: a tree
    mostly full, and one far below its capacity (only its live nodes computed); built as a new list
    and written into a fresh tree's own (a resume's buffer)."""
    from ray.rllib.execution import segment_tree
    cls = getattr(segment_tree, tree_cls)
    rng = np.random.default_rng(0)
    for cap, leaves in ((64, 64), (4096, 40)):
        for leaf_types in ((float, np.float64), (float, np.float64, np.float32)):
            tree = cls(cap)
            used = {}
            for _ in range(300):
                i = int(rng.integers(leaves))
                if i in used and rng.random() < 0.3:  # freed, as RLlib frees an evicted row's node
                    tree[i] = tree.neutral_element
                    del used[i]
                else:
                    used[i] = leaf_types[int(rng.integers(len(leaf_types)))](rng.random() * 3)
                    tree[i] = used[i]
            idx = np.array(sorted(used), np.int64)
            packed = pack_scalars([tree.value[cap + i] for i in idx.tolist()], "t")
            again, fresh = cls(1), cls(cap)  # a new list; and written into a fresh tree's own
            again.capacity = cap
            fresh_list = fresh.value
            rebuild_tree(again, idx, packed)
            rebuild_tree(fresh, idx, packed, into=fresh_list)
            assert fresh.value is fresh_list
            for t in (again, fresh):
                assert t.value[1:] == tree.value[1:]
                assert [type(x) for x in t.value[1:]] == [type(x) for x in tree.value[1:]]


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


def _ma_dqn_config(cb, seed=3):
    """:func:`test_rllib_replay._dqn_config` on MultiAgentCartPole: two agents, one policy each, its
    buffer the multi-agent prioritized one (same capacity, alpha, beta)."""
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
    cfg = _dqn_config(cb, seed)
    buffer = dict(cfg.replay_buffer_config, type="MultiAgentPrioritizedEpisodeReplayBuffer")
    return (cfg.environment(MultiAgentCartPole, env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=_ma_mapping)
            .training(replay_buffer_config=buffer))


def _resume_exactly(make_config, engine_factory, run_name, iterations, learner_check=None):
    """Trained ``iterations`` times with a save each, stopped, relaunched with resume=True: the
    learner (weights, target networks, optimizers), the counters, the process RNGs and the buffer
    (every attribute) come back, and the next batch drawn is the uninterrupted run's."""
    engine = engine_factory(critical_writers=1)
    algo = make_config(rr.make_callback(run_name, every=1, on_busy="wait")).build_algo()
    try:
        for _ in range(iterations):
            algo.train()
        assert sorted(rr.wait_for_saves(algo, timeout=120)) == list(range(1, iterations + 1))
        assert rr.find_callback(algo).engine.registered[jn.STATE_NAME] is rc.Strategy.CRITICAL  # off-policy: "auto"
        buf = algo.local_replay_buffer
        assert buf.get_num_episodes_evicted() > 0  # the buffer is full and evicting
        want_learner = _learner_state(algo)  # no update since the last iteration's save
        want_counters = engine.load(name="counters", version=iterations)
        if learner_check is not None:
            learner_check(want_learner)
    finally:
        algo.stop()  # the "preemption": the original buffer object stays here to compare with
    fresh = make_config(rr.make_callback(run_name, every=1, on_busy="wait", resume=True)).build_algo()
    try:
        report = rr.find_callback(fresh).resumed
        assert report.version == iterations and fresh.iteration == iterations
        assert report.states[jn.STATE_NAME] == "restored (local)"
        _assert_same(_learner_state(fresh), want_learner, "learner")
        from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME
        sampled = fresh.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME))
        assert sampled == want_counters[NUM_ENV_STEPS_SAMPLED_LIFETIME] > 0
        from ray_ckpt.capture.rng import rng_state
        _assert_same(_numpy(rr.to_storable(rng_state(), "rng")), _numpy(engine.load(name="rng", version=iterations)),
                     "rng")
        got = fresh.local_replay_buffer
        assert replay_compare.differences(buf, got) == []
        _assert_same(_episodes_state(_replay_sample(algo)), _episodes_state(_replay_sample(fresh)), "batch")
    finally:
        fresh.stop()
    return buf, got


@pytest.mark.slow  # 20-35 s: DQN's (test_rllib_replay_journal.py) covers the callback's replay path in the fast suite
@pytest.mark.timeout(240)
def test_sac_pendulum_buffer_saved_by_callback_restores_exactly(engine_factory, run_name):
    def sac_parts(learner):  # what makes SAC's learner SAC's: twin target Q networks, alpha and its optimizer
        params = learner["rl_module"]["default_policy"]
        assert any(k.startswith("target_qf") for k in params), sorted(params)
        assert learner["log_alpha"]["default_policy"] != 0.0  # trained away from initial_alpha=1.0
        assert {"default_policy_qf", "default_policy_qf_twin", "default_policy_policy",
                "default_policy_alpha"} <= set(learner["optimizer"]), sorted(learner["optimizer"])

    buf, got = _resume_exactly(_sac_config, engine_factory, run_name, iterations=3, learner_check=sac_parts)
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
        assert jn.STATE_NAME not in engine.list_checkpoints()[-1].states
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
        assert rr.find_callback(algo).engine.registered[jn.STATE_NAME] is rc.Strategy.BEST_EFFORT
        assert jn.STATE_NAME in set(_states_when_written(engine, 1))
        algo.local_replay_buffer.sampler = lambda: None  # an attribute the journal does not keep
        algo.train()  # not an error: the buffer is best effort
        rr.wait_for_saves(algo, timeout=120)
        meta = engine.list_checkpoints()[-1]
        assert meta.version == 2 and jn.STATE_NAME not in meta.states and "policy" in meta.states
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


def test_buffers_the_journal_does_not_keep_are_refused_by_name():
    """Another buffer family, or a subclass with state of its own: refused when the journal is made
    (the first save), naming the type and the attribute; an attribute set on the buffer later is
    refused at the next save."""
    from ray.rllib.utils.replay_buffers import ReplayBuffer
    with pytest.raises(rc.UnsupportedTypeError, match=r"ray\.rllib\.utils\.replay_buffers\.replay_buffer\.ReplayBuffer"):
        jn.journal_of(ReplayBuffer(capacity=10))

    class WithState(EpisodeReplayBuffer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.extra_counter = 3

    with pytest.raises(rc.UnsupportedTypeError, match=r"WithState: attribute 'extra_counter' is not one RLlib"):
        jn.journal_of(WithState(capacity=50))
    buf = _make("prioritized", capacity=50)
    buf.add(_sa_chunks(2, steps=10))
    j = jn.journal_of(buf)
    j.capture(buf)
    buf.sampler = lambda: None
    with pytest.raises(rc.UnsupportedTypeError, match=r"attribute 'sampler'"):
        j.capture(buf)


@pytest.mark.timeout(180)
def test_a_version_saved_before_the_journal_is_refused_naming_migrate(engine_factory, run_name, tmp_path):
    """A run written in the old two-state form (a fixture run from tests/fixtures/replay_formats, a
    version holding ``replay`` + ``replay_meta``, and nothing else): the restore report names
    ``ray-ckpt migrate`` for the buffer, which stays empty. (With strict=True, what a run of the time
    holds -- policy, optimizer... -- restores first, then the buffer raises RestoreError with this
    message: restore_algorithm_replay.)"""
    import shutil
    from pathlib import Path
    fixture = Path(__file__).parent / "fixtures" / "replay_formats" / "prioritized" / "local" / "prioritized_run"
    shutil.copytree(fixture, tmp_path / "local" / run_name)
    engine = engine_factory(critical_writers=1)
    assert "replay_meta" in engine.list_checkpoints()[-1].states
    algo = _dqn_config(rr.make_callback(run_name, every=1)).build_algo()
    try:
        report = rr.restore_algorithm(algo, engine, strict=False)
        for name in ("replay", "replay_meta"):
            assert "written before the replay journal" in report.states[name], report.states
            assert "ray-ckpt migrate" in report.states[name], report.states
        assert algo.local_replay_buffer.get_num_timesteps() == 0
    finally:
        algo.stop()
