"""The replay journal (integrations/rllib/replay/, format /6): single-agent buffers saved as the
records of what add() and update_priorities() received, written version after version through the
engine's own append-only writer and reader, and restored through RLlib's own API into fresh buffers
that equal the original attribute by attribute and sample the same. Real RLlib buffers and episodes;
no Ray cluster needed."""
import numpy as np
import pytest

pytest.importorskip("ray.rllib")

from ray_ckpt.errors import RestoreError  # noqa: E402
from ray_ckpt.integrations.rllib.replay import journal as jn  # noqa: E402
from ray_ckpt.integrations.rllib.replay.restore import read_records, restore_journal  # noqa: E402
from ray_ckpt.storage.tier import Tier  # noqa: E402

from replay_compare import buffer_state_equal, differences as _differences  # noqa: E402
from test_rllib_replay import (BUFFERS, _assert_same, _chunks_for, _fill, _ma_mapping, _make, _sa_chunks,  # noqa: E402
                               _sampled, _store_version)

def _restored(name, state, capacity, seed=99):
    fresh = _make(name, capacity=capacity, seed=seed)
    restore_journal(fresh, state, agent_to_module_mapping_fn=_ma_mapping)
    return fresh


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,compact,nested", [("plain", False, False), ("prioritized", False, False),
                                                 ("prioritized", True, False), ("prioritized", False, True),
                                                 ("multi_agent", False, False), ("multi_agent_prioritized", False, False),
                                                 ("multi_agent_prioritized", True, False)])
def test_versions_written_append_only_restore_exactly_and_a_restored_buffer_goes_on_alike(
        name, compact, nested, tmp_path, monkeypatch):
    """Saved every few add() calls (evictions and priority updates in between), each version is
    written as the engine's writers write an append-only state and read back verified; each restores
    into a fresh buffer equal to the original in every attribute; a buffer restored from version 3
    and fed the same chunks since captures the same rows as the uninterrupted one and samples alike.
    ``compact``: a STATE record replaces the priority records at nearly every save."""
    prioritized, multi_agent = "prioritized" in name, BUFFERS[name][2]
    if compact:
        monkeypatch.setattr(jn, "COMPACT_FACTOR", 0)
        monkeypatch.setattr(jn, "COMPACT_MIN", 12)
    tier = Tier(str(tmp_path / "tier"), "local")
    chunks = _chunks_for(name, nested) if multi_agent else _sa_chunks(0, steps=150, nested=nested)
    cap = 80 if multi_agent else 150
    buf = _make(name, capacity=cap)
    jn.journal_of(buf)  # the recorders from the start, as the callback puts them at the algorithm's start
    # multi-agent: one chunk per add(): RLlib's multi-agent add() mishandles two chunks of one episode
    # that it evicts in the same call (it drops one; later samples can fail on the buffer it leaves), and
    # the journal then writes the buffer whole (its index entries are not the chunks'): see the issue notes
    base, restored, step = {}, None, 1 if multi_agent else 6
    kinds = set()
    for v, i in enumerate(range(0, len(chunks), step), 1):
        for b in (buf, restored) if restored is not None else (buf,):
            _fill(b, chunks, prioritized, multi_agent, i, i + step, seed=v)
        state = jn.journal_of(buf).capture(buf)
        assert np.all(np.diff(state["row_id"]) > 0)
        files, back, _ = _store_version(tier, v, {jn.STATE_NAME: state}, base)
        base = files
        kinds |= {r.kind for r, _ in read_records(back[jn.STATE_NAME]["row_id"], back[jn.STATE_NAME]["blob"])}
        if restored is not None:
            again = jn.journal_of(restored).capture(restored)
            assert np.array_equal(again["row_id"], state["row_id"]) and np.array_equal(again["blob"], state["blob"]), v
        fresh = _restored(name, back[jn.STATE_NAME], cap)
        assert _differences(buf, fresh) == [], v
        if v == 3:
            restored = fresh
    assert buf.get_num_episodes_evicted() > (0 if multi_agent else 10)
    assert jn.ADD in kinds and (jn.PRIO in kinds) == (prioritized and not compact)
    assert (jn.STATE in kinds) == compact  # a buffer journaled from its start needs no STATE record
    for _ in range(2):
        _assert_same(_sampled(buf, multi_agent), _sampled(restored, multi_agent), "sample")
    assert _differences(buf, restored) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(BUFFERS))
def test_a_buffer_filled_before_its_journal_or_changed_behind_add_is_captured_whole(name, caplog):
    prioritized, multi_agent = "prioritized" in name, BUFFERS[name][2]
    chunks = _chunks_for(name) if multi_agent else _sa_chunks(1, steps=120)
    cap = 120 if multi_agent else 100
    buf = _make(name, capacity=cap)
    third_of = len(chunks) // 3
    _fill(buf, chunks, prioritized, multi_agent, 0, third_of)  # before the journal: the first save is a full capture
    j = jn.journal_of(buf)
    first = j.capture(buf)
    assert {r.kind for r in j.records} == {jn.ADD, jn.STATE}
    assert _differences(buf, _restored(name, first, cap)) == []
    _fill(buf, chunks, prioritized, multi_agent, third_of, len(chunks) - 3)
    second = j.capture(buf)
    assert _differences(buf, _restored(name, second, cap)) == []
    type(buf).add(buf, chunks[-3:])  # past the recorder: the journal notices and writes the buffer anew
    with caplog.at_level("INFO", logger="ray_ckpt"):
        third = j.capture(buf)
    assert "the buffer changed other than through add()" in caplog.text
    assert third["row_id"][0] > second["row_id"][-1]  # every row new: no id names two different rows
    assert _differences(buf, _restored(name, third, cap)) == []


@pytest.mark.timeout(60)
def test_a_journal_that_does_not_fit_the_buffer_is_refused_and_nothing_changes():
    buf = _make("prioritized", capacity=100)
    jn.journal_of(buf)
    _fill(buf, _sa_chunks(2, steps=40), True, False)
    state = jn.journal_of(buf).capture(buf)
    for other, cap, why in (("plain", 100, "restoring into a"), ("prioritized", 80, "capacity is 80")):
        fresh = _make(other, capacity=cap)
        _fill(fresh, _sa_chunks(3, steps=10), other == "prioritized", False)
        before = fresh.get_state()
        with pytest.raises(RestoreError, match=why):
            restore_journal(fresh, state)
        _assert_same(fresh.get_state(), before, "untouched")
    damaged = dict(state, blob=state["blob"].copy())
    damaged["blob"][1, 40] ^= 0xFF
    with pytest.raises(RestoreError, match="replay journal record at row"):
        restore_journal(_make("prioritized", capacity=100), damaged)


# ---------------------------------------------------------------- saved by the RLlib callback
@pytest.mark.timeout(300)
def test_dqn_buffer_journaled_by_the_callback_resumes_exactly_and_goes_on_writing_only_new_rows(
        engine_factory, run_name, monkeypatch):
    """DQN (prioritized buffer, CartPole) saved every iteration by the callback as a journal: a
    relaunched Algorithm resumes a buffer equal to the original in every attribute, draws the same
    next batch, and its next version keeps the restored rows (same ids) and adds new ones; set back
    to an older version, its rows get ids above every stored one."""
    from ray_ckpt.integrations import rllib as rr
    from test_rllib_replay import _dqn_config, _episodes_state, _learner_state, _replay_sample
    engine = engine_factory(critical_writers=1)
    algo = _dqn_config(rr.make_callback(run_name, every=1, on_busy="wait")).build_algo()
    try:
        for _ in range(4):
            algo.train()
        assert sorted(rr.wait_for_saves(algo, timeout=120)) == [1, 2, 3, 4]
        metas = engine.list_checkpoints()
        assert all(jn.STATE_NAME in m.states and "replay" not in m.states for m in metas)
        buf = algo.local_replay_buffer
        assert buf.get_num_episodes_evicted() > 0
        j3, j4 = (engine.load(name=jn.STATE_NAME, version=v) for v in (3, 4))
        common, i3, i4 = np.intersect1d(j3["row_id"], j4["row_id"], return_indices=True)
        assert len(common) > 0 and np.array_equal(j3["blob"][i3], j4["blob"][i4])  # a row id keeps its bytes
        kinds = {r.kind for r, _ in read_records(j4["row_id"], j4["blob"])}
        assert kinds == {jn.ADD, jn.PRIO}  # journaled from the algorithm's start: no whole-buffer record
        want_learner = _learner_state(algo)
    finally:
        algo.stop()
    fresh = _dqn_config(rr.make_callback(run_name, every=1, on_busy="wait", resume=True)).build_algo()
    try:
        report = rr.find_callback(fresh).resumed
        assert report.version == 4 and report.states[jn.STATE_NAME] == "restored (local)"
        _assert_same(_learner_state(fresh), want_learner, "learner")
        got = fresh.local_replay_buffer
        assert _differences(buf, got) == []
        _assert_same(_episodes_state(_replay_sample(algo)), _episodes_state(_replay_sample(fresh)), "batch")
        fresh.train()
        rr.wait_for_saves(fresh, timeout=120)
        j5 = engine.load(name=jn.STATE_NAME, version=5)
        common, i4, i5 = np.intersect1d(j4["row_id"], j5["row_id"], return_indices=True)
        assert len(common) > 0 and np.array_equal(j4["blob"][i4], j5["blob"][i5])
        assert np.setdiff1d(j5["row_id"], j4["row_id"]).min() > j4["row_id"].max()
        rr.restore_algorithm(fresh, engine, version=3)  # set back: ids of version 3 may name other rows in 5
        fresh.train()
        rr.wait_for_saves(fresh, timeout=120)
        j6 = engine.load(name=jn.STATE_NAME, version=6)
        assert j6["row_id"].min() > j5["row_id"].max()
        back = type(fresh.local_replay_buffer)(capacity=fresh.local_replay_buffer.capacity,
                                               alpha=fresh.local_replay_buffer._alpha)
        restore_journal(back, j6)
        assert buffer_state_equal(fresh.local_replay_buffer, back) == []
    finally:
        fresh.stop()


@pytest.mark.timeout(300)
def test_multi_agent_dqn_buffer_journaled_by_the_callback_resumes_exactly(engine_factory, run_name):
    """Two policies, a multi-agent prioritized buffer that evicts, saved every iteration by the
    callback (the default format): resumed into a fresh Algorithm, the buffer equals the original
    (per-module trees, counters, generator) and the next version keeps the restored rows."""
    from ray_ckpt.integrations import rllib as rr
    from test_rllib_replay import _ma_dqn_config
    engine = engine_factory(critical_writers=1)
    algo = _ma_dqn_config(rr.make_callback(run_name, every=1, on_busy="wait")).build_algo()
    try:
        for _ in range(3):
            algo.train()
        assert sorted(rr.wait_for_saves(algo, timeout=120)) == [1, 2, 3]
        buf = algo.local_replay_buffer
        assert buf.get_num_episodes_evicted() > 0 and len(buf._module_to_indices) == 2
        j3 = engine.load(name=jn.STATE_NAME, version=3)
    finally:
        algo.stop()
    fresh = _ma_dqn_config(rr.make_callback(run_name, every=1, on_busy="wait", resume=True)).build_algo()
    try:
        assert rr.find_callback(fresh).resumed.states[jn.STATE_NAME] == "restored (local)"
        assert _differences(buf, fresh.local_replay_buffer) == []
        fresh.train()
        rr.wait_for_saves(fresh, timeout=120)
        j4 = engine.load(name=jn.STATE_NAME, version=4)
        common, i3, i4 = np.intersect1d(j3["row_id"], j4["row_id"], return_indices=True)
        assert len(common) > 0 and np.array_equal(j3["blob"][i3], j4["blob"][i4])
    finally:
        fresh.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["prioritized", "multi_agent_prioritized"])
def test_between_rare_saves_the_journal_keeps_no_more_than_the_buffer_holds(name, monkeypatch):
    """Saved rarely (here: once, after the whole run), the journal drops the recorded add() calls
    whose episodes RLlib evicted meanwhile, and once the recorded priority updates outgrow the
    buffer it drops them too and writes every leaf at the next save: what it keeps between saves is
    bounded by the buffer, not by the time since the last save. The save restores exactly."""
    monkeypatch.setattr(jn, "COMPACT_FACTOR", 0 if BUFFERS[name][2] else 2)
    monkeypatch.setattr(jn, "COMPACT_MIN", 16)
    multi_agent = BUFFERS[name][2]
    chunks = _chunks_for(name) if multi_agent else _sa_chunks(4, steps=300)
    cap = 60 if multi_agent else 80
    buf = _make(name, capacity=cap)
    j = jn.journal_of(buf)
    held = []
    step = 1 if multi_agent else 3  # one chunk per multi-agent add(): see the versions test
    for i in range(0, len(chunks), step):
        _fill(buf, chunks, True, multi_agent, i, i + step, seed=i)
        held.append(len(j.adds))
    assert buf.get_num_episodes_evicted() > (1 if multi_agent else 3)
    assert held[-1] < len(held)  # evicted calls left: the journal did not keep every call since the start
    assert j.state_due and j.prio_entries <= jn.COMPACT_FACTOR * buf.get_num_timesteps() + jn.COMPACT_MIN
    state = j.capture(buf)
    assert jn.STATE in {r.kind for r in j.records} and jn.PRIO not in {r.kind for r in j.records}
    assert _differences(buf, _restored(name, state, cap)) == []


@pytest.mark.timeout(120)
def test_the_journal_holds_no_space_object_past_a_save():
    """Episodes from remote env runners arrive with their own copies of the observation and action
    spaces. Once a save has encoded them, the journal keeps none alive: after 60 add() calls and 6
    saves, the only live spaces are those of the episodes the buffer still holds (before the fix,
    its space cache held every episode's, evicted or not: 120 here)."""
    import copy
    import gc
    import weakref

    import gymnasium as gym
    from ray.rllib.env.single_agent_episode import SingleAgentEpisode
    from ray.rllib.utils.replay_buffers import EpisodeReplayBuffer

    obs_space, act_space = gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2)
    buf = EpisodeReplayBuffer(capacity=200)
    j = jn.journal_of(buf)
    spaces = []
    for i in range(60):
        o, a = copy.deepcopy(obs_space), copy.deepcopy(act_space)
        o.seed(i)
        a.seed(i)
        spaces += [weakref.ref(o), weakref.ref(a)]
        ep = SingleAgentEpisode(observations=[o.sample()], observation_space=o, action_space=a)
        for _ in range(5):
            ep.add_env_step(o.sample(), a.sample(), 1.0)
        ep.is_terminated = True
        buf.add([ep])
        del o, a, ep
        if i % 10 == 9:
            j.capture(buf)
    gc.collect()
    held = len(buf.episodes)
    assert 0 < held < 60 and buf.get_num_episodes_evicted() > 0
    assert sum(r() is not None for r in spaces) <= 2 * held


def test_free_nodes_of_a_large_buffer_come_back_exactly():
    """A 1M-row buffer's free-node deque (~2M nodes) is stored as its freed nodes plus a range and
    comes back as it was, save after save as RLlib pops and frees nodes at the left (also when
    written into a fresh buffer's own deque); one whose end is not the range any more is stored whole."""
    import collections
    from ray_ckpt.integrations.rllib.replay.trees import free_nodes_from, free_nodes_state
    n = 2 * 2**20
    dq = collections.deque(range(n), maxlen=n)
    for step in range(5):
        for _ in range(500):
            dq.popleft()
        if step % 2:
            dq.appendleft(7 + step)
        st = free_nodes_state(dq)
        assert "all" not in st and st["stop"] == n
        assert free_nodes_from(st) == dq
        fresh = collections.deque(range(n), maxlen=n)  # a fresh buffer's own, made the stored one in place
        assert free_nodes_from(st, into=fresh) is fresh and fresh == dq and fresh.maxlen == n
    dq[-1] = 3
    st = free_nodes_state(dq)
    assert "all" in st and free_nodes_from(st) == dq


def test_record_bytes_are_those_of_ray_ckpts_flatten():
    """A record's bytes (its structure JSON, array forms and bytes) are those built through
    ray_ckpt's flatten, which the fast walk stands in for; a leaf the walk does not know still goes
    through flatten, which names what it cannot store."""
    import collections
    from ray_ckpt.errors import UnsupportedTypeError
    from ray_ckpt.integrations.rllib.replay.records import bytes_state, state_bytes, state_bytes_generic
    state = {"a": [1.5, float("nan"), float("-inf"), -0.0, True, None, "x\u00e9\"", b"\x00\x01", 2**70],
             None: (1, 2), True: {3: np.float32(2.5), -4: np.bool_(True)}, False: np.int64(7),
             "od": collections.OrderedDict([("z", 1)]), "be": np.arange(12, dtype=">i4").reshape(3, 4),
             "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2], "empty": np.empty((0, 3), np.float32),
             "scalar": np.array(3.5), "b": np.array([True, False]), "f16": np.ones(5, np.float16),
             "u": np.array(["ab", "c"]), "big": np.array([-5, 3, 1 << 40]), "steps": np.arange(0, 3000, 3),
             "episodes": _sa_chunks(0, steps=20)[0].get_state()["observations"]}
    assert state_bytes(state) == state_bytes_generic(state)
    _assert_same(bytes_state(state_bytes(state), "record"), bytes_state(state_bytes_generic(state), "r"), "record")
    with pytest.raises(UnsupportedTypeError, match=r"\['s'\]"):
        state_bytes({"s": {1, 2}})
